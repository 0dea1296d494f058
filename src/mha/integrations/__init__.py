"""mha inside other libraries. Each integration imports its library only when it is imported:

    mha.integrations.transformers   register(): attn_implementation="mha" in HuggingFace transformers
"""
