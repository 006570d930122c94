"""The torch.distributed MoE dispatch/combine benchmark (the local stand-in for DeepEP's test_ep).

``moe_a2a`` is the script run under torchrun; ``result`` turns its JSON into gates and tables.
"""
