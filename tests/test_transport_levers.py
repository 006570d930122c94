"""The transport levers AWS ships today: GIN type 5 as a named contract (its env, its floor
against the pin sets, its per-rank gates), and ElasticBuffer's timeouts through the guide's vLLM
patch 0002 (applied by the real GNU patch to vLLM 0.24.0's own file, its line gated per rank
only where a run's site applied it). Logs are composed in the formats their sources print:
NCCL's debug prefix and ENV line (NVIDIA/nccl src/debug.cc; aws/aws-ofi-nccl
doc/gin-getting-started.md) and the patch's own print."""
import shutil
import subprocess

import pytest

from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.engines import site_patches, transport, vllm_logs
from lib.engines.nccl_logs import env_setting_per_rank
from lib.roots import pins
from lib.stages import registry

PATCH_0002 = REPO_ROOT / pins.load()["pins"]["vllm_patch_deepep_v2_timeouts"]["path"]
ALL2ALL = "vllm/distributed/device_communicators/all2all.py"
ALL2ALL_0_24 = REPO_ROOT / "tests" / "fixtures" / "vllm-0.24.0" / "all2all.py"


# ---- the contract --------------------------------------------------------------------------
def test_type5_is_type2_with_exactly_its_two_settings():
    two, five = transport.transport_env("efa"), transport.transport_env("gin_type5")
    assert two["NCCL_GIN_TYPE"] == "2" and five["NCCL_GIN_TYPE"] == "5"
    assert five["NCCL_SYM_GIN_KERNELS_ENABLE"] == "0" and "NCCL_SYM_GIN_KERNELS_ENABLE" not in two
    changed = {k for k in set(two) | set(five) if two.get(k) != five.get(k)}
    assert changed == {"NCCL_GIN_TYPE", "NCCL_SYM_GIN_KERNELS_ENABLE"}
    assert transport.unset_vars("gin_type5") == transport.unset_vars("efa")
    assert all(v.why and v.anchor for v in transport.contract("gin_type5"))
    assert transport.over_efa("gin_type5") and not transport.over_efa("intranode_nvlink")


def test_both_efa_contracts_set_the_elastic_buffer_timeouts_the_patch_reads():
    for name in transport.EFA_TRANSPORTS:
        env = transport.transport_env(name)
        assert env[transport.GPU_TIMEOUT_VAR] == env[transport.CPU_TIMEOUT_VAR] == "600"
    patch = PATCH_0002.read_text()
    assert transport.GPU_TIMEOUT_VAR in patch and transport.CPU_TIMEOUT_VAR in patch


def test_the_floor_refuses_every_pin_set_below_nccl_2_31_and_allows_the_one_above():
    data = pins.load()
    allowed = [n for n in pins.set_names(data)
               if not transport.floor_problems("gin_type5", pins.set_pins(data, n))]
    assert allowed == ["newest-2026-12"]  # NCCL 2.31.2, installer 1.51.0; the rest pin 2.30.4
    # the rule, once, in the stage's model (lib.stages.rules_engines), through resolve
    with pytest.raises(ParameterError) as refused:
        registry.resolve("04_serve", {"context": "plan", "transport": "gin_type5",
                                      "pin_set": "seed-2026-07"})
    said = str(refused.value)
    assert "'transport'" in said and "seed-2026-07" in said and "nccl 2.30.4 < 2.31" in said
    assert "-p pin_set newest-2026-12" in said
    low = {"nccl": {"version": "2.31.0"}, "efa_installer": {"version": "1.49.1"}}
    assert transport.floor_problems("gin_type5", low) == [
        "efa_installer 1.49.1 < 1.50 (EFA installer >= 1.50 (libfabric 2.6.0, rdma-core "
        "64.0amzn0, efa driver 3.3.0, aws-ofi-nccl 1.21))"]
    assert transport.floor_problems("gin_type5", {}) and not transport.floor_problems(
        "efa", {})


@pytest.mark.parametrize("given, param, words", [
    ({"context": "local", "transport": "gin_type5"}, "transport", "intranode_nvlink on the"),
    ({"context": "plan", "transport": "intranode_nvlink"}, "transport", "efa or gin_type5"),
    ({"context": "plan", "transport": "gin_type5"}, "transport", "nccl 2.30.4 < 2.31"),
    ({"context": "kube", "transport": "gin_type5", "pin_set": "current"}, "transport",
     "pin set 'current'"),
    ({"context": "plan", "transport": "gin_type4"}, "transport", "efa, gin_type5"),
])
def test_the_registry_refuses_a_transport_its_place_or_pin_set_cannot_carry(given, param, words):
    with pytest.raises(ParameterError) as refused:
        registry.resolve("03_kernel_test", given)
    assert refused.value.name == param and words in str(refused.value)


def test_the_registry_takes_type5_with_a_pin_set_above_its_floor_and_defaults_per_context():
    ok = registry.resolve("04_serve", {"context": "plan", "transport": "gin_type5",
                                       "pin_set": "newest-2026-12"})
    assert ok["transport"] == "gin_type5"
    assert registry.resolve("03_kernel_test", {"context": "plan"})["transport"] == "efa"
    assert registry.resolve("03_kernel_test", {})["transport"] == "intranode_nvlink"
    takes = [s for s, names in registry.STAGE_PARAMS.items() if "transport" in names]
    assert takes == ["03_kernel_test", "04_serve", "05_sweep", "06_multicomm", "07_train"]


# ---- per-rank gates --------------------------------------------------------------------------
def nccl_log(world: int, settings: dict[int, dict[str, str]],
             loaded: dict[int, str] | None = None) -> str:
    """One process per rank on two hosts: NCCL's ENV lines, the GIN plugin NCCL assigned it
    (``loaded``: rank -> "<plugin> type <N>", NCCL 2.30.x's form; "<plugin>" alone, the later
    form without the type), then its communicator's Init COMPLETE."""
    lines = []
    for rank in range(world):
        host, pid = f"node-{rank // 8}", 4000 + rank
        for var, value in settings.get(rank, {}).items():
            lines.append(f"{host}:{pid}:{pid} [{rank % 8}] NCCL INFO {var} set by environment "
                         f"to {value}.")
        if rank in (loaded or {}):
            said = loaded[rank]
            lines.append(f"{host}:{pid}:{pid} [{rank % 8}] NCCL INFO " + (
                f"GIN/Plugin: Assigned plugin {said} to comm" if " type " in said
                else f"Assigned GIN plugin {said} to comm"))
        lines.append(f"{host}:{pid}:{pid} [{rank % 8}] NCCL INFO ncclCommInitRank comm "
                     f"0x55{rank:04x} rank {rank} nranks {world} cudaDev {rank % 8} nvmlDev "
                     f"{rank % 8} busId 1000 commId 0x1 - Init COMPLETE")
    return "\n".join(lines) + "\n"


TYPE5 = {"NCCL_GIN_TYPE": "5", "NCCL_SYM_GIN_KERNELS_ENABLE": "0"}


GDAKI = {r: "Libfabric_GDAKI type 5" for r in range(16)}


def test_type5_gates_pass_when_every_rank_read_both_settings_and_loaded_type5():
    text = nccl_log(16, {r: TYPE5 for r in range(16)}, GDAKI)
    gates = vllm_logs.transport_gates(text, 16, "gin_type5", log_name="pods")
    assert [g["status"] for g in gates] == ["PASS", "PASS", "PASS"]
    assert gates[2]["gate"] == "nccl_gin_type_5_assigned_per_rank"
    assert gates[2]["observed"]["type_per_rank"] == {str(r): 5 for r in range(16)}
    # the later NCCL form names the plugin only: its type read from the plugin's known name
    later = nccl_log(16, {r: TYPE5 for r in range(16)}, {r: "Libfabric_GDAKI" for r in range(16)})
    assert vllm_logs.transport_gates(later, 16, "gin_type5")[2]["status"] == "PASS"
    assert gates[0]["observed"]["ranks"] == list(range(16))
    assert gates[0]["evidence"][0].startswith("pods:1: node-0:4000:4000 [0] NCCL INFO "
                                              "NCCL_GIN_TYPE set by environment to 5.")
    assert vllm_logs.transport_gates(text, 16, "efa") == []


def test_type5_gates_fail_on_a_rank_without_it_and_on_a_rank_on_the_proxy():
    missing = {r: TYPE5 for r in range(16) if r != 11}
    gin = vllm_logs.transport_gates(nccl_log(16, missing), 16, "gin_type5")[0]
    assert gin["status"] == "FAIL" and gin["observed"]["missing"] == [11]
    proxy = {**{r: TYPE5 for r in range(16)}, 3: {"NCCL_GIN_TYPE": "2"}}
    gin, sym, _ = vllm_logs.transport_gates(nccl_log(16, proxy), 16, "gin_type5")
    assert gin["status"] == "FAIL" and "another value than 5" in gin["reason"]
    assert any("NCCL_GIN_TYPE set by environment to 2" in e for e in gin["evidence"])
    assert sym["status"] == "FAIL" and sym["observed"]["missing"] == [3]
    none = env_setting_per_rank(nccl_log(16, {}), 16, "NCCL_GIN_TYPE", "5")
    assert none["status"] == "FAIL" and "NCCL_DEBUG=INFO without ENV" in none["reason"]


def test_a_type5_request_that_loaded_type2_fails_naming_the_rank():
    """Every rank asked for type 5 and read both settings; NCCL assigned rank 11 the type-2
    plugin: the environment gates PASS, the one of what loaded FAILs naming rank 11."""
    loaded = {**GDAKI, 11: "Libfabric type 2"}
    asked, sym, gin = vllm_logs.transport_gates(nccl_log(16, {r: TYPE5 for r in range(16)},
                                                         loaded), 16, "gin_type5", log_name="pods")
    assert (asked["status"], sym["status"]) == ("PASS", "PASS")
    assert gin["status"] == "FAIL" and gin["reason"].startswith("rank 11: type 2, not GIN type 5")
    assert gin["evidence"][0].endswith("GIN/Plugin: Assigned plugin Libfabric type 2 to comm")
    # a rank that printed no assignment (none loaded): named too
    gone = vllm_logs.transport_gates(nccl_log(16, {r: TYPE5 for r in range(16)},
                                              {r: v for r, v in GDAKI.items() if r != 4}),
                                     16, "gin_type5")[2]
    assert gone["status"] == "FAIL" and gone["reason"].startswith("rank(s) 4 of 16: no ")


def timeouts_log(world: int, values: dict[int, tuple[int, int]]) -> str:
    return "".join(f"(EngineCore_DP{r} pid={900 + r}) [guide-0002] DeepEPV2All2AllManager rank "
                   f"{r}/{world}: ElasticBuffer num_gpu_timeout_secs={g} num_cpu_timeout_secs={c}\n"
                   for r, (g, c) in values.items())


APPLIED = [{"site": "/s/vllm-site", "patches": [
    {"pin": "vllm_patch_deepep_v2_expert_ids", "unchanged": True},
    {"pin": "vllm_patch_deepep_v2_timeouts", "unchanged": True}]}]


def test_the_timeout_line_is_gated_on_every_rank_only_where_the_site_applied_0002():
    every = timeouts_log(16, {r: (600, 600) for r in range(16)})
    assert vllm_logs.elastic_timeouts_gate(every, 16, site_patches=APPLIED)["status"] == "PASS"
    # a run recorded before 0002 (its site_patches lists 0001 alone, or none): SKIP, never FAIL
    before = [{"site": "/s", "patches": [APPLIED[0]["patches"][0]]}]
    for recorded in (before, [], None):
        g = vllm_logs.elastic_timeouts_gate("", 16, site_patches=recorded)
        assert g["status"] == "SKIP" and "defaults (GPU 100 s, CPU 300 s)" in g["reason"]
    edited = [{"site": "/s", "patches": [{**APPLIED[0]["patches"][1], "unchanged": False}]}]
    assert vllm_logs.elastic_timeouts_gate(every, 16, site_patches=edited)["status"] == "SKIP"
    short = timeouts_log(16, {r: (600, 600) for r in range(16) if r != 9})
    g = vllm_logs.elastic_timeouts_gate(short, 16, site_patches=APPLIED)
    assert g["status"] == "FAIL" and g["observed"]["missing"] == [9]
    low = timeouts_log(16, {**{r: (600, 600) for r in range(16)}, 4: (100, 300)})
    g = vllm_logs.elastic_timeouts_gate(low, 16, site_patches=APPLIED)
    assert g["status"] == "FAIL" and "rank(s) 4 built" in g["reason"]


# ---- patch 0002 against vLLM 0.24.0's own file ---------------------------------------------------
@pytest.mark.skipif(shutil.which("patch") is None, reason="Missing required program: patch")
def test_patch_0002_applies_to_vllm_0_24_0s_file_and_passes_and_prints_the_timeouts(tmp_path):
    site = tmp_path / "vllm-site"
    (site / ALL2ALL).parent.mkdir(parents=True)
    (site / ALL2ALL).write_bytes(ALL2ALL_0_24.read_bytes())
    dry = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "--batch", "-d", str(site),
                          "-i", str(PATCH_0002)], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    before = (site / ALL2ALL).read_text()
    assert "num_gpu_timeout_secs" not in before  # vLLM 0.24.0 passes no timeout
    subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d",
                    str(site), "-i", str(PATCH_0002)], check=True, capture_output=True,
                   timeout=60)
    after = (site / ALL2ALL).read_text()
    assert "**self._timeouts," in after and "[guide-0002] DeepEPV2All2AllManager rank" in after
    compile(after, ALL2ALL, "exec")  # still Python
    assert site_patches.sha256_file(PATCH_0002) == pins.load()["pins"][
        "vllm_patch_deepep_v2_timeouts"]["sha256"]
    line = ('[guide-0002] DeepEPV2All2AllManager rank 0/16: ElasticBuffer '
            'num_gpu_timeout_secs=600 num_cpu_timeout_secs=600')
    assert vllm_logs._TIMEOUTS_RE.search(line)


# ---- the issue's plan: 03 and 04 rendered with type 5, 06's lever on a cluster place ---------
def plan_stage(run_dir, name: str, given: dict):
    from lib.core.door import Door
    from lib.core.stage import Stage
    engine = {"engine": "vllm"} if "engine" in registry.STAGE_PARAMS[name] else {}
    resolved = registry.resolve(name, {"context": "plan", **engine, **given})
    return Stage(name, resolved, run_dir, Door(run_dir, name, plan=True), None)


def env_of(manifest_text: str) -> dict[str, str]:
    import yaml
    env = {}
    for doc in yaml.safe_load_all(manifest_text):
        for pod in [doc] if doc and doc.get("kind") == "Pod" else [
                (doc or {}).get("spec", {}).get("template", {})]:
            for c in (pod.get("spec") or {}).get("containers") or []:
                env.update({e["name"]: e.get("value") for e in c.get("env") or []})
    return env


@pytest.mark.parametrize("name, run", [("03_kernel_test", "kernel"), ("04_serve", "serve")])
@pytest.mark.parametrize("contract, gin_type", [("gin_type5", "5"), ("efa", "2")])
def test_03_and_04_planned_with_a_contract_render_its_env(tmp_path, name, run, contract,
                                                          gin_type):
    """`-p context plan -p transport gin_type5 -p pin_set newest-2026-12`: every rendered pod's
    env carries type 5 and the symmetric kernels off; `efa` renders the proxy, type 2."""
    import importlib
    stage = plan_stage(tmp_path, name, {"transport": contract, "pin_set": "newest-2026-12"})
    importlib.import_module(f"lib.stages.{run}").run(stage)
    rendered = sorted((tmp_path / name / "manifests").glob("*.yaml"))
    assert rendered
    for path in rendered:
        env = env_of(path.read_text())
        assert env["NCCL_GIN_TYPE"] == gin_type, path.name
        assert env.get("NCCL_SYM_GIN_KERNELS_ENABLE") == ("0" if gin_type == "5" else None)


def test_06_lists_the_transport_ab_as_a_lever_skipped_below_its_floor(tmp_path):
    """On a cluster place 06 names the GIN type 5 A/B; on the recorded pin set (NCCL 2.30.4)
    it SKIPs naming the floor; on a pin set above it the arm is type 5 at arm a's comms."""
    from lib import places
    from lib.measure.serving import Arm
    from lib.stages import lever
    below = plan_stage(tmp_path / "below", "06_multicomm", {})
    lever.run(below)
    skipped = next(g for g in below.gates if g.gate == lever.GIN_LEVER)
    assert skipped.status == "SKIP" and "nccl 2.30.4 < 2.31" in skipped.reason
    above = plan_stage(tmp_path / "above", "06_multicomm", {"pin_set": "newest-2026-12"})
    base = Arm("EP_NUM_COMMS=1", "vllm-epnc1", False, True, num_comms=1)
    arm = lever.gin_arm(above, places.for_stage(above), base)
    assert (arm.name, arm.slug, arm.transport, arm.num_comms) == (
        "GIN type 5, EP_NUM_COMMS=1", "vllm-epnc1-gin5", "gin_type5", 1)
    assert not [g for g in above.gates if g.gate == lever.GIN_LEVER]
    typed5 = plan_stage(tmp_path / "typed5", "06_multicomm",
                        {"pin_set": "newest-2026-12", "transport": "gin_type5"})
    back = lever.gin_arm(typed5, places.for_stage(typed5), base)
    assert (back.transport, back.slug) == ("efa", "vllm-epnc1-gin2")


def test_a_plan_of_06_renders_every_arm_the_transport_arm_with_type_5(tmp_path, monkeypatch):
    """`run --context plan` of 04 and 06 on a pin set above type 5's floor: 06 renders each
    arm's serve in turn (EP_NUM_COMMS a and b over type 2, the lever's arm over type 5), each
    checked, and SKIPs the A/B naming every arm; no FAIL."""
    import json
    from lib import runner
    from lib.stages import lever

    monkeypatch.setattr(runner, "RESULTS", tmp_path)
    run_dir, rc = runner.run_guide("plan", "plan-gin", {
        "engine": "vllm", "pin_set": "newest-2026-12", "nodes": "2",
        "results_dir": str(tmp_path)}, ["04_serve", "06_multicomm"])
    assert rc == 0
    gates = json.loads((run_dir / "06_multicomm" / "gates.json").read_text())
    assert not [g for g in gates if g["status"] == "FAIL"]
    assert not [g for g in gates if g["gate"] == lever.GIN_LEVER]  # the arm, not its SKIP
    manifests = run_dir / "06_multicomm" / "manifests"
    contracts = {slug: env_of((manifests / f"{slug}.yaml").read_text())["NCCL_GIN_TYPE"]
                 for slug in ("vllm-epnc1-1", "vllm-epnc8-1", "vllm-epnc1-gin5-1")}
    assert contracts == {"vllm-epnc1-1": "2", "vllm-epnc8-1": "2", "vllm-epnc1-gin5-1": "5"}
    assert env_of((manifests / "vllm-epnc1-gin5-1.yaml").read_text())[
        "NCCL_SYM_GIN_KERNELS_ENABLE"] == "0"
    (ab,) = [g for g in gates if g["gate"] == "serving A/B"]
    assert ab["status"] == "SKIP"
    for arm in ("EP_NUM_COMMS=1: ", "EP_NUM_COMMS=8: ", "GIN type 5, EP_NUM_COMMS=1: "):
        assert arm in ab["reason"], arm
