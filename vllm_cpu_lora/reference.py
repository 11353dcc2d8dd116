"""Pure-torch LoRA ops: the oracle for every test and the fallback path.

These follow vLLM's `vllm/lora/ops/torch_ops/lora_ops.py` algorithm (gather
one weight matrix per token, batched GEMV) with vLLM 0.33's semantics:

* index ``-1`` means "no LoRA": shrink writes zeros for such rows, expand
  leaves them untouched (also when ``add_inputs=False``);
* expand writes ``min(weight rows, output width)`` columns because adapter and
  model may pad differently;
* the sgmv forms apply segment ``i`` (tokens ``b_seq_start_loc[i]`` to
  ``b_seq_start_loc[i] + seq_len_tensor[i]``) to adapter
  ``lora_indices_tensor[i]``; tokens outside every segment are not touched.

Arithmetic is done in float32 (float64 if the output is float64) and rounded
once to the output dtype, so the functions are device- and dtype-agnostic and
can serve as an oracle when given float64 tensors.
"""

import torch

__all__ = [
    "bgmv_shrink",
    "bgmv_expand",
    "bgmv_expand_slice",
    "sgmv_shrink",
    "sgmv_expand",
    "sgmv_expand_slice",
    "dispatch_bgmv",
    "dispatch_bgmv_low_level",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_3d(weights: torch.Tensor) -> torch.Tensor:
    # vLLM stacks weights as [L, 1, rows, cols] or [L, rows, cols].
    return weights.squeeze(1) if weights.dim() == 4 else weights


def _gather_matvec(inputs, weights, indices, dtype):
    """Per-token ``inputs[b] @ weights[indices[b]].T`` for rows with an
    adapter; returns (rows, products)."""
    rows = torch.nonzero(indices >= 0).flatten()
    selected = weights[indices[rows]].to(dtype)
    products = torch.einsum("bi,boi->bo", inputs[rows].to(dtype), selected)
    return rows, products


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """``out[b, :r] = scaling * inputs[b] @ A[idx[b]].T``; rows with idx -1
    get 0."""
    weights = _as_3d(lora_a_weights)
    rank = weights.size(1)
    dtype = _compute_dtype(output_tensor.dtype)
    indices = lora_indices_tensor[: inputs.size(0)].long()
    rows, products = _gather_matvec(inputs, weights, indices, dtype)
    result = torch.zeros(
        inputs.size(0), rank, dtype=dtype, device=output_tensor.device
    )
    result[rows] = scaling * products
    output_tensor[:, :rank] = result.to(output_tensor.dtype)


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """``out[b, off:off+n] (+)= inputs[b] @ B[idx[b]].T`` with
    ``n = min(B rows, slice_size)``; rows with idx -1 are left untouched."""
    weights = _as_3d(lora_b_weights)
    width = min(weights.size(1), slice_size)
    dtype = _compute_dtype(output_tensor.dtype)
    indices = lora_indices_tensor[: inputs.size(0)].long()
    rows, products = _gather_matvec(inputs, weights[:, :width], indices, dtype)
    target = output_tensor[:, slice_offset : slice_offset + width]
    if add_inputs:
        products = products + target[rows].to(dtype)
    target[rows] = products.to(output_tensor.dtype)


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """``out[b, :n] (+)= inputs[b] @ B[idx[b]].T``, ``n = min(B rows, out
    width)``; rows with idx -1 are left untouched."""
    bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        lora_indices_tensor,
        0,
        output_tensor.size(1),
        add_inputs,
    )


def _segments(b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches):
    starts = b_seq_start_loc[:batches].tolist()
    lengths = seq_len_tensor[:batches].tolist()
    indices = lora_indices_tensor[:batches]
    for i in range(batches):
        yield slice(starts[i], starts[i] + lengths[i]), indices[i : i + 1]


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    """bgmv_shrink applied segment by segment."""
    del max_seq_length, token_nums  # Hints only.
    for rows, index in _segments(
        b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches
    ):
        count = rows.stop - rows.start
        bgmv_shrink(
            inputs[rows],
            lora_a_weights,
            output_tensor[rows],
            index.expand(count),
            scaling,
        )


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    """bgmv_expand_slice applied segment by segment."""
    del max_seq_length, token_nums  # Hints only.
    for rows, index in _segments(
        b_seq_start_loc, seq_len_tensor, lora_indices_tensor, batches
    ):
        count = rows.stop - rows.start
        bgmv_expand_slice(
            inputs[rows],
            lora_b_weights,
            output_tensor[rows],
            index.expand(count),
            slice_offset,
            slice_size,
            add_inputs,
        )


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    """bgmv_expand applied segment by segment."""
    sgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        b_seq_start_loc,
        seq_len_tensor,
        lora_indices_tensor,
        batches,
        max_seq_length,
        token_nums,
        0,
        output_tensor.size(1),
        add_inputs,
    )


def dispatch_bgmv_low_level(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    indicies: torch.Tensor,
    layer_idx: int,
    scale: float,
    h_in: int,
    h_out: int,
    y_offset: int,
) -> None:
    """Legacy punica: ``y[:, off:off+h_out] += scale * x @
    w[idx, layer_idx, :h_out, :h_in].T``, x having exactly h_in columns;
    idx < 0 skips the row; index entries past x's rows are not read."""
    dtype = _compute_dtype(y.dtype)
    weights = w[:, layer_idx, :h_out, :h_in]
    indices = indicies[: x.size(0)].long()
    indices = torch.where(indices < 0, -1, indices)
    rows, products = _gather_matvec(x, weights, indices, dtype)
    target = y[:, y_offset : y_offset + h_out]
    target[rows] = (target[rows].to(dtype) + scale * products).to(y.dtype)


def dispatch_bgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    indicies: torch.Tensor,
    layer_idx: int,
    scale: float,
) -> None:
    """Legacy punica: ``y += scale * x @ w[idx, layer_idx].T``."""
    dispatch_bgmv_low_level(
        y, x, w, indicies, layer_idx, scale, w.size(3), w.size(2), 0
    )
