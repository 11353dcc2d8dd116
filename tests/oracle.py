"""The oracle and the error bound every kernel test compares against.

The oracle is `vllm_cpu_lora.reference` run in float64 on the same operand
values. The kernels' arithmetic (documented in csrc/cpu/bgmv_impl.h):

* products of the operands as given, except that fp32 inputs are rounded to
  bf16 when the weights and the output are bf16 (vLLM's torch ops cast inputs
  to the output dtype; this lets AVX512-BF16/AMX pair products be used);
* accumulation in fp32, in any order, over k terms;
* scale, add the old output (add mode), one rounding to the output dtype.

So with S = |scale| * sum_k |x_k w_k| + |old| (old only in add mode), the
standard bound for a sum of k+2 fp32-rounded terms in any order gives

    |got - want| <= (k + 2) * u32 * S + u_x * |scale| * sum|x w|
                    + u_out * |want|  (+ second-order and subnormal terms)

with u32 = 2^-24, u_x = 2^-8 under the input-rounding rule above (else 0) and
u_out the unit roundoff of the output dtype (2^-8 bf16, 2^-11 fp16, 2^-24
fp32). On `neon_bf16`, bf16 pair products (Arm BFDOT, without FEAT_EBF16)
round each pair sum and each accumulation to odd, whose error is up to a
whole fp32 ulp: u32 is 2^-23 there (`accumulation_roundoff`). BFDOT also
flushes subnormal values, which the tests' operands and sums never are.
The bound is rigorous for any summation order; the exact-integer tests
(small integer operands, where every step is exact) complement it with a zero
tolerance, which catches a single missing or doubled term.
"""

import torch

# The ops under test, by family.
SHRINK_OPS = ("bgmv_shrink", "sgmv_shrink")
EXPAND_OPS = (
    "bgmv_expand",
    "bgmv_expand_slice",
    "sgmv_expand",
    "sgmv_expand_slice",
)
VLLM_OPS = SHRINK_OPS + EXPAND_OPS
DISPATCH_OPS = ("dispatch_bgmv", "dispatch_bgmv_low_level")
ALL_OPS = VLLM_OPS + DISPATCH_OPS
# All the slices of a layer in one call (tests/test_ops_multi_slice.py).
MULTI_SLICE_OPS = ("lora_shrink", "lora_expand")

UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}

HALF_SUBNORMAL = {
    torch.float32: 2.0**-150,
    torch.bfloat16: 2.0**-134,
    torch.float16: 2.0**-25,
}


def input_roundoff(x_dtype, w_dtype, out_dtype) -> float:
    """u_x: rounding of fp32 inputs to bf16 under the bf16-weights,
    bf16-output rule."""
    if (
        x_dtype == torch.float32
        and w_dtype == torch.bfloat16
        and out_dtype == torch.bfloat16
    ):
        return 2.0**-8
    return 0.0


def uses_pair_products(x_dtype, w_dtype, out_dtype) -> bool:
    """Whether the bf16-dot paths multiply in bf16 pairs (kernel_common.h's
    kPairs): bf16 weights with bf16 inputs, or fp32 inputs rounded to bf16."""
    return w_dtype == torch.bfloat16 and (
        x_dtype == torch.bfloat16
        or (x_dtype == torch.float32 and out_dtype == torch.bfloat16)
    )


def accumulation_roundoff(isa, x_dtype, w_dtype, out_dtype) -> float:
    """u32: the error of each fp32 step, relative; nearest rounding except in
    neon_bf16's BFDOT pair products, which round to odd (up to one ulp)."""
    if isa == "neon_bf16" and uses_pair_products(x_dtype, w_dtype, out_dtype):
        return 2.0**-23
    return UNIT_ROUNDOFF[torch.float32]


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def run_oracle(op_name: str, args: list, out_index: int, abs_inputs=()):
    """Runs reference.<op_name> in float64.

    `args` are the kernel's arguments; floating tensors, also in lists, are
    converted to float64 copies (those at positions in `abs_inputs` also made
    absolute, to compute the magnitude S). Returns the float64 output tensor.
    """
    from vllm_cpu_lora import reference

    def convert(a, absolute):
        if isinstance(a, list):
            return [convert(t, absolute) for t in a]
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return f64(a).abs() if absolute else f64(a)
        if isinstance(a, float) and absolute:
            return abs(a)
        return a

    converted = [convert(a, i in abs_inputs) for i, a in enumerate(args)]
    getattr(reference, op_name)(*converted)
    return converted[out_index]


def assert_close_to_oracle(
    got: torch.Tensor,
    want: torch.Tensor,
    magnitude: torch.Tensor,
    old_magnitude: torch.Tensor | None,
    k: int,
    x_dtype,
    w_dtype,
    out_dtype,
    isa: str | None = None,
) -> None:
    """Checks `got` against the float64 oracle `want` with the bound above.

    `magnitude` is |scale| * sum|x w| per element (the oracle run on absolute
    values, 0 where nothing is written); `old_magnitude` is |old output| in
    add mode, else None; `isa` the path that computed `got` (None: one that
    rounds to nearest). NaN in `want` (poison the kernel must not touch) must
    be NaN in `got` too.
    """
    got = f64(got)
    poisoned = torch.isnan(want)
    assert torch.equal(torch.isnan(got), poisoned), (
        "kernel wrote elements it must leave alone, or left elements unwritten"
    )
    s = magnitude.clone()
    if old_magnitude is not None:
        s = s + old_magnitude
    u_out = UNIT_ROUNDOFF[out_dtype]
    u32 = accumulation_roundoff(isa, x_dtype, w_dtype, out_dtype)
    fp32_error = (k + 2) * u32 * s + input_roundoff(
        x_dtype, w_dtype, out_dtype
    ) * magnitude
    # The final rounding is relative to the fp32 value (want + its error),
    # plus half the smallest subnormal of the output type.
    bound = (
        (1 + u_out) * fp32_error
        + u_out * want.abs()
        + HALF_SUBNORMAL[out_dtype]
    )
    ok = ~poisoned
    err = (got - want).abs()
    bad = (err > bound) & ok
    assert not bad.any(), (
        f"{int(bad.sum())} elements outside the error bound; worst excess "
        f"{float((err - bound)[ok].max()):.3g} at {bad.nonzero()[0].tolist()}"
    )
