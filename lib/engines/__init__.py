"""What serves and what it is given: transformers serve, vLLM (argv/env, logs, site patches), DeepEP, transport contracts."""
