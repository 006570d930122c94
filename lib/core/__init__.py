"""The evidence core: door, evidence, redaction, errors, parameters' rules, the stage object."""
