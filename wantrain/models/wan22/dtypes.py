"""The base dtypes that store the blocks' Linears quantised (``model.base_dtype``): one place for the sections
(``models.wan22.config``), their rules (``models.wan22.rules``) and the adapter to read them from."""

FP8_DTYPES = ("fp8", "fp8_scaled")  # base dtypes that store the blocks' Linears in float8_e4m3fn
LOW_BIT_DTYPES = ("int8", "nf4")  # ... as bitsandbytes codes (lowbit.py)
QUANTISED_DTYPES = FP8_DTYPES + LOW_BIT_DTYPES  # compute from a dequantised bf16 copy of each Linear
