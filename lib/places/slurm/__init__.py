"""The slurm place: a Slurm cluster through sbatch, srun, squeue, scontrol and scancel, every
call through the door.

    place     SlurmPlace: the software on the nodes (image or venv), the partition's nodes and
              their probe, rank jobs (one allocation, one step), its allocations and steps
    serve     SlurmServing, which the place holds: a server as steps of an allocation (the
              one an A/B's arms share), its readiness and its logs gated
    aiperf    AIPerf as one more step of a serve's allocation
    waits     its clients' timeouts, and squeue/scontrol polled until a job runs, is gone, or
              has left COMPLETING
    sbatch    what it sends, as data and text: sbatch and srun argv, the per-node wrapper, the
              node probe script, a plan's batch script
    parse     what comes back: sinfo, scontrol, squeue, srun's report, the probe's lines
    plan      SlurmPlanned: what the place does instead of acting while its door plans
              (context plan): its effects turned into records
"""
