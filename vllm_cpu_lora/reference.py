"""Pure-torch LoRA ops: the oracle for every test and the fallback path.

These follow vLLM's `vllm/lora/ops/torch_ops/lora_ops.py` algorithm (gather
one weight matrix per token, batched GEMV) with vLLM 0.33's semantics:

* index ``-1`` means "no LoRA": shrink writes zeros for such rows, expand
  leaves them untouched (also when ``add_inputs=False``);
* expand writes ``min(weight rows, output width)`` columns because adapter and
  model may pad differently; expand_slice needs ``slice_size`` equal to the
  weight rows;
* the bgmv forms take one index per row of ``inputs``;
* ``lora_shrink`` and ``lora_expand`` take all the slices of a layer (as
  vLLM's Triton ops of those names): shrink writes slice ``s`` into
  ``output_tensor[s]``, expand reads ``inputs[s]`` and writes its columns
  after those of the slices before it, from ``offset_start``;
* the sgmv forms apply segment ``i``, the next ``seq_len_tensor[i]`` tokens,
  to adapter ``lora_indices_tensor[i]``: the segments run back to back and
  cover every row of ``inputs`` (vLLM's ops read neither ``b_seq_start_loc``
  nor ``batches``).

Where vLLM's ops raise, these raise too (a ``RuntimeError`` naming the
argument).

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
    "lora_shrink",
    "lora_expand",
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


def _indices(lora_indices_tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if lora_indices_tensor.numel() != rows:
        raise RuntimeError(
            f"lora_indices_tensor has {lora_indices_tensor.numel()} entries, "
            f"expected {rows} (one per row of inputs)"
        )
    return lora_indices_tensor.long()


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
    indices = _indices(lora_indices_tensor, inputs.size(0))
    rows, products = _gather_matvec(inputs, weights, indices, dtype)
    result = torch.zeros(
        inputs.size(0), rank, dtype=dtype, device=output_tensor.device
    )
    result[rows] = scaling * products
    output_tensor[:, :rank] = result.to(output_tensor.dtype)


def _expand(
    inputs: torch.Tensor,
    weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    width: int,
    add_inputs: bool,
) -> None:
    """``out[b, off:off+width] (+)= inputs[b] @ B[idx[b], :width].T``; rows
    with idx -1 are left untouched."""
    dtype = _compute_dtype(output_tensor.dtype)
    indices = _indices(lora_indices_tensor, inputs.size(0))
    rows, products = _gather_matvec(inputs, weights[:, :width], indices, dtype)
    target = output_tensor[:, slice_offset : slice_offset + width]
    if add_inputs:
        products = products + target[rows].to(dtype)
    target[rows] = products.to(output_tensor.dtype)


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """``out[b, off:off+size] (+)= inputs[b] @ B[idx[b]].T``, B having
    ``slice_size`` rows; rows with idx -1 are left untouched."""
    weights = _as_3d(lora_b_weights)
    if weights.size(1) != slice_size:
        raise RuntimeError(
            f"slice_size {slice_size} differs from the {weights.size(1)} "
            "rows of lora_b_weights"
        )
    _expand(
        inputs,
        weights,
        output_tensor,
        lora_indices_tensor,
        slice_offset,
        slice_size,
        add_inputs,
    )


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """``out[b, :n] (+)= inputs[b] @ B[idx[b]].T``, ``n = min(B rows, out
    width)``; rows with idx -1 are left untouched."""
    weights = _as_3d(lora_b_weights)
    width = min(weights.size(1), output_tensor.size(1))
    _expand(
        inputs,
        weights,
        output_tensor,
        lora_indices_tensor,
        0,
        width,
        add_inputs,
    )


def _token_indices(
    inputs: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
) -> torch.Tensor:
    """The adapter of every token: segment i's for its seq_len_tensor[i]
    tokens, the segments back to back (as vLLM's ops)."""
    if seq_len_tensor.numel() != lora_indices_tensor.numel():
        raise RuntimeError(
            f"seq_len_tensor has {seq_len_tensor.numel()} entries but "
            f"lora_indices_tensor has {lora_indices_tensor.numel()}"
        )
    if bool((seq_len_tensor < 0).any()):
        raise RuntimeError("seq_len_tensor has a negative length")
    total = int(seq_len_tensor.sum())
    if total != inputs.size(0):
        raise RuntimeError(
            f"seq_len_tensor sums to {total} tokens but inputs has "
            f"{inputs.size(0)} rows: the segments must cover every row"
        )
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


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
    """bgmv_shrink with each segment's adapter for its tokens."""
    del b_seq_start_loc, batches, max_seq_length, token_nums  # vLLM's too.
    indices = _token_indices(inputs, seq_len_tensor, lora_indices_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, indices, scaling)


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
    """bgmv_expand_slice with each segment's adapter for its tokens."""
    del b_seq_start_loc, batches, max_seq_length, token_nums  # vLLM's too.
    indices = _token_indices(inputs, seq_len_tensor, lora_indices_tensor)
    bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        indices,
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
    """bgmv_expand with each segment's adapter for its tokens."""
    del b_seq_start_loc, batches, max_seq_length, token_nums  # vLLM's too.
    indices = _token_indices(inputs, seq_len_tensor, lora_indices_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, indices, add_inputs)


def _check_slices(
    stacked: torch.Tensor, stacked_name: str, weights, weights_name: str
) -> None:
    if len(weights) == 0:
        raise RuntimeError(f"{weights_name} must hold at least one slice")
    if stacked.dim() != 3 or stacked.size(0) != len(weights):
        raise RuntimeError(
            f"{stacked_name} must be [{len(weights)} slices, tokens, rank], "
            f"got shape {list(stacked.shape)}"
        )


def lora_shrink(
    inputs: torch.Tensor,
    lora_a_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_indices: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """bgmv_shrink of every slice: ``output_tensor[s]`` from
    ``lora_a_weights[s]``."""
    _check_slices(
        output_tensor, "output_tensor", lora_a_weights, "lora_a_weights"
    )
    for s, weights in enumerate(lora_a_weights):
        bgmv_shrink(
            inputs, weights, output_tensor[s], token_lora_indices, scaling
        )


def lora_expand(
    inputs: torch.Tensor,
    lora_b_weights: list[torch.Tensor],
    output_tensor: torch.Tensor,
    token_lora_indices: torch.Tensor,
    offset_start: int = 0,
    add_inputs: bool = True,
) -> None:
    """bgmv_expand_slice of every slice: ``inputs[s]`` through
    ``lora_b_weights[s]`` into the next columns of ``output_tensor``, from
    ``offset_start``."""
    _check_slices(inputs, "inputs", lora_b_weights, "lora_b_weights")
    offset = offset_start
    for s, weights in enumerate(lora_b_weights):
        rows = _as_3d(weights).size(1)
        if offset < 0 or offset + rows > output_tensor.size(1):
            raise RuntimeError(
                f"offset_start {offset_start} and the rows of "
                f"lora_b_weights[0..{s}] ({offset - offset_start + rows}) do "
                f"not fit in output_tensor of width {output_tensor.size(1)}"
            )
        bgmv_expand_slice(
            inputs[s],
            weights,
            output_tensor,
            token_lora_indices,
            offset,
            rows,
            add_inputs,
        )
        offset += rows


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
