"""Adapters that plug fa_gen into other libraries; each imports its library only when used.

    fa_gen.integrations.transformers.register()    # attn_implementation="fa_gen" in Hugging Face transformers
"""
