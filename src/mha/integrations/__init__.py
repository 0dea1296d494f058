"""mha inside other libraries. Each integration imports its library only when it is imported:

    mha.integrations.transformers   register(): attn_implementation="mha" in HuggingFace transformers
"""

__all__: list[str] = []  # each integration is a submodule, imported on request
