"""Hostile arguments: every call of the table must fail cleanly.

Each entry is a call that must raise RuntimeError (what TORCH_CHECK raises)
with a message naming the offending argument, and must leave every tensor
it was given bit-identical (outputs are poisoned first): the checks run
before any memory is touched.

Every entry runs through `torch.ops.vllm_cpu_lora`; the entries of the ops
with an eager fast path also through `vllm_cpu_lora.ops`, and those of the
multi-slice ops (which vLLM's compiled model calls) also from a
`torch.compile`d function. The table runs in-process (one pytest case per
entry and way) and once more in a child process (`python
tests/test_bad_inputs.py` runs every entry), so a crash shows up as a test
failure instead of killing the test run.

Entries for known kernel bugs may carry `bug=` (xfail, strict, with the
bug as the reason); if the bug is undefined behaviour, also `ub=True`, which
skips them under scripts/sanitize.sh, where UBSan would stop the whole run.
None do now: the bugs this table found were fixed, and these entries fail
if one comes back (docs/validation.md says how each was fixed):
`slice_overflow` and `y_offset_overflow` (bounds checks that overflowed
int64), `isa_unknown` and `isa_unknown_no_lora` (the ISA variable checked
after writing, or not at all), `alias_output_is_inputs_non_dense` (aliasing
through non-dense views), `index_on_meta` and `starts_on_meta` (mixed
CPU/meta calls running the no-op fake kernel). The overflow entries keep
their outputs inside larger buffers, so that a regression writes into
memory the test owns and fails cleanly.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from oracle import DISPATCH_OPS, MULTI_SLICE_OPS, SHRINK_OPS, VLLM_OPS

import vllm_cpu_lora

ISA_ENV = "VLLM_CPU_LORA_ISA"
SANITIZED = os.environ.get("VLLM_CPU_LORA_SANITIZED") == "1"

T, H, R, L = 4, 24, 8, 3  # Tokens, hidden size, rank, adapters.
LAYERS = 2
NAN = float("nan")
# Poison of add-mode outputs (dispatch ops' y): NaN would hide a write there,
# since NaN + anything is NaN.
POISON = -1234.5
INT64_MAX = 2**63 - 1


def _nan(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, NAN, dtype=dtype)


def _poison(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=dtype)


def _idx(*values, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _randn(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def weights_name(op: str) -> str:
    return "lora_a_weights" if op in SHRINK_OPS else "lora_b_weights"


# Rows of the two lora_expand slices.
EXPAND_SLICES = (6, 10)


def base_args(op: str) -> dict:
    """Valid arguments of `op`, by schema name in schema order; outputs are
    poisoned (NaN, or POISON in add mode) and some rows have no LoRA."""
    if op == "lora_shrink":
        return {
            "inputs": _randn(T, H),
            "lora_a_weights": [_randn(L, R, H), _randn(L, 1, R, H)],
            "output_tensor": _nan(2, T, R),
            "token_lora_indices": _idx(0, 2, -1, 1),
            "scaling": 0.5,
        }
    if op == "lora_expand":
        return {
            "inputs": _randn(2, T, R),
            "lora_b_weights": [_randn(L, n, R) for n in EXPAND_SLICES],
            "output_tensor": _nan(T, H),
            "token_lora_indices": _idx(0, 2, -1, 1),
            "offset_start": 2,
            "add_inputs": False,
        }
    if op in DISPATCH_OPS:
        args = {
            "y": _poison(T, R + 2),
            "x": _randn(T, H),
            "w": _randn(L, LAYERS, R, H),
            "indicies": _idx(0, -1, 2, -7),
            "layer_idx": 1,
            "scale": 0.5,
        }
        if op == "dispatch_bgmv_low_level":
            args.update(h_in=H, h_out=R - 1, y_offset=2)
        return args
    if op in SHRINK_OPS:
        x, w, out = _randn(T, H), _randn(L, R, H), _nan(T, R)
    elif op.endswith("_slice"):  # The weights fill the slice, as vLLM's.
        x, w, out = _randn(T, R), _randn(L, H - 4, R), _nan(T, H)
    else:
        x, w, out = _randn(T, R), _randn(L, H, R), _nan(T, H)
    args = {"inputs": x, weights_name(op): w, "output_tensor": out}
    if op.startswith("bgmv"):
        args["lora_indices_tensor"] = _idx(0, 2, -1, 1)
    else:
        args.update(
            b_seq_start_loc=_idx(0, 2),
            seq_len_tensor=_idx(2, 2),
            lora_indices_tensor=_idx(-1, 1),
            batches=2,
            max_seq_length=2,
            token_nums=T,
        )
    if op.endswith("_slice"):
        args.update(slice_offset=2, slice_size=H - 4)
    if op in SHRINK_OPS:
        args["scaling"] = 0.5
    else:
        args["add_inputs"] = False
    return args


@dataclasses.dataclass(frozen=True)
class Bad:
    """One call that must fail.

    Attributes:
        op: The op (torch.ops.vllm_cpu_lora.<op>).
        case: What is wrong; `id` is "op/case".
        mutate: Turns base_args(op) into the bad arguments (in place).
        names: The message must name one of these (whole word).
        env: Environment variables set during the call.
        bug: A known kernel bug that makes the entry misbehave: xfail.
        ub: The bug is undefined behaviour: skipped under the sanitizers.
    """

    op: str
    case: str
    mutate: Callable[[dict], None]
    names: tuple
    env: tuple = ()
    bug: str | None = None
    ub: bool = False

    @property
    def id(self) -> str:
        return f"{self.op}/{self.case}"


def _set(**values) -> Callable[[dict], None]:
    return lambda a: a.update(values)


def _overlapping_rows(a: dict) -> None:
    """An output whose rows overlap: row stride one below the width."""
    t, w = a["output_tensor"].shape
    buf = _nan(t * w, dtype=a["output_tensor"].dtype)
    a["output_tensor"] = buf.as_strided((t, w), (w - 1, 1))


def _alias_inputs(a: dict) -> None:
    """The output is the inputs tensor itself."""
    a["output_tensor"] = a["inputs"]
    if "slice_offset" in a:
        a.update(slice_offset=0, slice_size=a["inputs"].size(1))


def _alias_inputs_partially(a: dict) -> None:
    """Output and inputs: overlapping row ranges of one buffer."""
    x = a["inputs"]
    buffer = _randn(x.size(0) + 2, x.size(1))
    a["inputs"], a["output_tensor"] = buffer[2:], buffer[:-2]
    if "slice_offset" in a:
        a.update(slice_offset=0, slice_size=x.size(1))


def _alias_inputs_non_dense(a: dict) -> None:
    """Output and inputs: the same column slice of a wider buffer (two
    views, the same elements)."""
    x = a["inputs"]
    buffer = _randn(x.size(0), 2 * x.size(1))
    a["inputs"] = buffer[:, : x.size(1)]
    a["output_tensor"] = buffer[:, : x.size(1)]
    if "slice_offset" in a:
        a.update(slice_offset=0, slice_size=x.size(1))


def _alias_weights(a: dict) -> None:
    """The output is a view of the first rows of the weights."""
    name = next(n for n in a if n.startswith("lora_"))
    w = a[name]
    a["output_tensor"] = w.view(-1, w.size(-1))[:T]
    if "slice_offset" in a:
        a.update(slice_offset=0, slice_size=w.size(-1))


def _alias_indices(a: dict) -> None:
    """The output's storage also holds the (zero, so valid) indices."""
    out = a["output_tensor"]
    storage = torch.zeros(out.numel() + 64, dtype=torch.float32)
    a["output_tensor"] = storage[: out.numel()].view(out.shape)
    a["lora_indices_tensor"] = storage.view(torch.int64)[:T]


def _isa_no_lora(a: dict) -> None:
    """Every row / segment without LoRA."""
    if "indicies" in a:
        a["indicies"] = _idx(-1, -1, -1, -1)
    elif "token_lora_indices" in a:
        a["token_lora_indices"] = _idx(-1, -1, -1, -1)
    elif "b_seq_start_loc" in a:
        a["lora_indices_tensor"] = _idx(-1, -1)
    else:
        a["lora_indices_tensor"] = _idx(-1, -1, -1, -1)


def _isa_entries(op: str) -> list[Bad]:
    """An unknown VLLM_CPU_LORA_ISA, with rows that have an adapter and
    with none (the variable is checked before anything is written)."""
    env = ((ISA_ENV, "no_such_isa"),)
    return [
        Bad(op, "isa_unknown", lambda a: None, (ISA_ENV,), env=env),
        Bad(op, "isa_unknown_no_lora", _isa_no_lora, (ISA_ENV,), env=env),
    ]


def _slice_overflow(a: dict) -> None:
    """slice_offset + slice_size wraps around; the output is a corner of a
    larger buffer so the stray writes stay in memory the test owns."""
    out = a["output_tensor"]
    room = _nan(out.size(0) + 2, 3 * out.size(1))
    a["output_tensor"] = room[: out.size(0), : out.size(1)]
    a.update(slice_offset=1, slice_size=INT64_MAX)


def _y_offset_overflow(a: dict) -> None:
    """y_offset + h_out wraps around; y starts 2 rows into a larger buffer
    so the writes at the wrapped (negative) offset stay in it."""
    y = a["y"]
    room = _poison(y.size(0) + 2, 2 * y.size(1))
    a["y"] = room[2:, 8 : 8 + y.size(1)]
    a["y_offset"] = 2**63 - a["h_out"]


def vllm_entries(op: str) -> list[Bad]:
    w_name = weights_name(op)
    k = H if op in SHRINK_OPS else R  # Columns of inputs.
    entries = [
        Bad(op, "inputs_1d", _set(inputs=_randn(k)), ("inputs",)),
        Bad(op, "inputs_3d", _set(inputs=_randn(T, 1, k)), ("inputs",)),
        Bad(
            op,
            "inputs_float64",
            _set(inputs=_randn(T, k, dtype=torch.float64)),
            ("inputs",),
        ),
        Bad(
            op,
            "inputs_int32",
            _set(inputs=torch.ones(T, k, dtype=torch.int32)),
            ("inputs",),
        ),
        Bad(
            op,
            "inputs_columns_mismatch",
            _set(inputs=_randn(T, k + 1)),
            ("inputs",),
        ),
        Bad(op, "weights_2d", _set(**{w_name: _randn(L, k)}), (w_name,)),
        Bad(
            op, "weights_5d", _set(**{w_name: _randn(L, 1, 1, 8, k)}), (w_name,)
        ),
        Bad(
            op,
            "weights_4d_not_1",
            _set(**{w_name: _randn(L, 2, 8, k)}),
            (w_name,),
        ),
        Bad(
            op,
            "weights_float64",
            _set(**{w_name: _randn(L, 8, k, dtype=torch.float64)}),
            (w_name,),
        ),
        Bad(
            op,
            "weights_int64",
            _set(**{w_name: torch.ones(L, 8, k, dtype=torch.int64)}),
            (w_name,),
        ),
        Bad(
            op, "output_1d", _set(output_tensor=_nan(T * H)), ("output_tensor",)
        ),
        Bad(
            op,
            "output_3d",
            _set(output_tensor=_nan(T, 1, H)),
            ("output_tensor",),
        ),
        Bad(
            op,
            "output_wrong_rows",
            _set(output_tensor=_nan(T + 1, H)),
            ("output_tensor",),
        ),
        Bad(
            op,
            "output_float64",
            _set(output_tensor=_nan(T, H, dtype=torch.float64)),
            ("output_tensor",),
        ),
        Bad(
            op,
            "output_int32",
            _set(output_tensor=torch.zeros(T, H, dtype=torch.int32)),
            ("output_tensor",),
        ),
        Bad(
            op,
            "output_strided_columns",
            _set(output_tensor=_nan(H, T).t()),
            ("output_tensor",),
        ),
        Bad(
            op,
            "output_rows_overlap",
            _set(output_tensor=_nan(1, H).expand(T, H)),
            ("output_tensor",),
        ),
        Bad(op, "alias_output_is_inputs", _alias_inputs, ("output_tensor",)),
        Bad(
            op,
            "alias_output_overlaps_inputs",
            _alias_inputs_partially,
            ("output_tensor",),
        ),
        Bad(op, "alias_output_in_weights", _alias_weights, ("output_tensor",)),
        Bad(op, "alias_output_and_indices", _alias_indices, ("output_tensor",)),
        Bad(
            op,
            "alias_output_is_inputs_non_dense",
            _alias_inputs_non_dense,
            ("output_tensor",),
        ),
        Bad(
            op,
            "output_rows_partly_overlap",
            _overlapping_rows,
            ("output_tensor",),
        ),
        *_isa_entries(op),
    ]
    if op in SHRINK_OPS:
        entries.append(
            Bad(
                op,
                "output_narrower_than_rank",
                _set(output_tensor=_nan(T, R - 1)),
                ("output_tensor",),
            )
        )
    if op.endswith("_slice"):
        entries += [
            Bad(
                op,
                "slice_size_not_weight_rows",
                _set(slice_size=H - 5),
                ("slice_size",),
            ),
            Bad(
                op,
                "slice_past_end",
                _set(slice_offset=H - 3),
                ("slice_offset",),
            ),
            Bad(
                op,
                "slice_wider_than_output",
                _set(slice_offset=0, slice_size=H + 1),
                ("slice_size",),
            ),
            Bad(
                op,
                "slice_offset_negative",
                _set(slice_offset=-1),
                ("slice_offset",),
            ),
            Bad(
                op, "slice_size_negative", _set(slice_size=-1), ("slice_size",)
            ),
            Bad(
                op,
                "slice_offset_too_big",
                _set(slice_offset=INT64_MAX, slice_size=0),
                ("slice_offset",),
            ),
            Bad(
                op,
                "slice_overflow",
                _slice_overflow,
                ("slice_offset", "slice_size"),
            ),
        ]
    if op.startswith("bgmv"):
        name = ("lora_indices_tensor",)
        entries += [
            Bad(
                op,
                "index_equal_to_num_loras",
                _set(lora_indices_tensor=_idx(0, L, 0, 0)),
                name,
            ),
            Bad(
                op,
                "index_below_minus_one",
                _set(lora_indices_tensor=_idx(0, -2, 0, 0)),
                name,
            ),
            Bad(
                op,
                "index_int64_min",
                _set(lora_indices_tensor=_idx(0, 0, 0, -(2**63))),
                name,
            ),
            Bad(
                op,
                "index_int32_too_big",
                _set(
                    lora_indices_tensor=_idx(
                        0, 0, 2**31 - 1, 0, dtype=torch.int32
                    )
                ),
                name,
            ),
            Bad(
                op,
                "index_float",
                _set(lora_indices_tensor=torch.zeros(T)),
                name,
            ),
            Bad(
                op,
                "index_bool",
                _set(lora_indices_tensor=torch.zeros(T, dtype=torch.bool)),
                name,
            ),
            Bad(
                op,
                "index_uint8",
                _set(lora_indices_tensor=torch.zeros(T, dtype=torch.uint8)),
                name,
            ),
            Bad(
                op,
                "index_2d",
                _set(lora_indices_tensor=_idx(0, 0, 0, 0).view(2, 2)),
                name,
            ),
            Bad(
                op,
                "index_too_short",
                _set(lora_indices_tensor=_idx(0, 0, 0)),
                name,
            ),
            Bad(
                op,
                "index_too_long",
                _set(lora_indices_tensor=_idx(0, 0, 0, 0, 0)),
                name,
            ),
            Bad(
                op,
                "index_on_meta",
                _set(lora_indices_tensor=_idx(0, 0, 0, 0).to("meta")),
                (*name, "Meta", "meta"),
            ),
        ]
    else:
        starts, lens = ("b_seq_start_loc",), ("seq_len_tensor",)
        lora = ("lora_indices_tensor",)
        entries += [
            Bad(
                op,
                "index_equal_to_num_loras",
                _set(lora_indices_tensor=_idx(0, L)),
                lora,
            ),
            Bad(
                op,
                "index_below_minus_one",
                _set(lora_indices_tensor=_idx(0, -2)),
                lora,
            ),
            Bad(
                op,
                "index_float",
                _set(lora_indices_tensor=torch.zeros(2)),
                lora,
            ),
            Bad(op, "index_too_short", _set(lora_indices_tensor=_idx(0)), lora),
            Bad(
                op,
                "index_too_long",
                _set(lora_indices_tensor=_idx(0, 1, 0)),
                lora,
            ),
            Bad(
                op,
                "start_past_end",
                _set(b_seq_start_loc=_idx(0, T + 1), seq_len_tensor=_idx(2, 0)),
                starts,
            ),
            Bad(
                op, "start_negative", _set(b_seq_start_loc=_idx(-1, 2)), starts
            ),
            Bad(
                op,
                "segment_past_end",
                _set(b_seq_start_loc=_idx(0, T - 1)),
                starts + lens,
            ),
            Bad(
                op,
                "start_not_back_to_back",
                _set(b_seq_start_loc=_idx(0, 3)),
                starts,
            ),
            Bad(
                op,
                "segments_do_not_cover_inputs",
                _set(seq_len_tensor=_idx(2, 1)),
                lens,
            ),
            Bad(
                op,
                "segments_cover_more_than_inputs",
                _set(b_seq_start_loc=_idx(0, 3), seq_len_tensor=_idx(3, 3)),
                lens,
            ),
            Bad(
                op,
                "lengths_longer_than_batches",
                _set(seq_len_tensor=_idx(2, 2, 0)),
                lens,
            ),
            Bad(
                op,
                "batches_zero_with_tokens",
                _set(batches=0),
                starts + ("batches",),
            ),
            Bad(op, "length_negative", _set(seq_len_tensor=_idx(2, -1)), lens),
            Bad(
                op, "length_too_big", _set(seq_len_tensor=_idx(T + 1, 0)), lens
            ),
            Bad(
                op,
                "segments_overlap",
                _set(b_seq_start_loc=_idx(0, 1)),
                starts + lens,
            ),
            Bad(
                op,
                "segments_overlap_unsorted",
                _set(b_seq_start_loc=_idx(2, 0), seq_len_tensor=_idx(2, 3)),
                starts + lens,
            ),
            Bad(op, "batches_past_tensors", _set(batches=3), starts),
            Bad(op, "batches_negative", _set(batches=-1), ("batches",)),
            Bad(
                op,
                "lengths_shorter_than_batches",
                _set(seq_len_tensor=_idx(2)),
                lens,
            ),
            Bad(
                op,
                "starts_float",
                _set(b_seq_start_loc=torch.tensor([0.0, 2.0])),
                starts,
            ),
            Bad(
                op,
                "lengths_2d",
                _set(seq_len_tensor=_idx(2, 2).view(1, 2)),
                lens,
            ),
            Bad(
                op,
                "starts_on_meta",
                _set(b_seq_start_loc=_idx(0, 2).to("meta")),
                (*starts, "Meta", "meta"),
            ),
        ]
    return entries


def dispatch_entries(op: str) -> list[Bad]:
    low = op == "dispatch_bgmv_low_level"
    idx = ("indicies",)
    entries = [
        Bad(
            op, "index_equal_to_num_loras", _set(indicies=_idx(0, L, 0, 0)), idx
        ),
        Bad(op, "index_float", _set(indicies=torch.zeros(T)), idx),
        Bad(op, "index_2d", _set(indicies=_idx(0, 0, 0, 0).view(2, 2)), idx),
        Bad(op, "index_too_short", _set(indicies=_idx(0, 0, 0)), idx),
        Bad(
            op,
            "index_on_meta",
            _set(indicies=_idx(0, 0, 0, 0).to("meta")),
            (*idx, "Meta", "meta"),
        ),
        Bad(op, "layer_idx_too_big", _set(layer_idx=LAYERS), ("layer_idx",)),
        Bad(op, "layer_idx_negative", _set(layer_idx=-1), ("layer_idx",)),
        Bad(op, "x_1d", _set(x=_randn(H)), ("x",)),
        Bad(op, "x_3d", _set(x=_randn(T, 1, H)), ("x",)),
        Bad(op, "x_columns_mismatch", _set(x=_randn(T, H + 1)), ("x",)),
        Bad(op, "x_float64", _set(x=_randn(T, H, dtype=torch.float64)), ("x",)),
        Bad(op, "w_3d", _set(w=_randn(L, R, H)), ("w",)),
        Bad(op, "w_5d", _set(w=_randn(L, LAYERS, 1, R, H)), ("w",)),
        Bad(
            op,
            "w_float64",
            _set(w=_randn(L, LAYERS, R, H, dtype=torch.float64)),
            ("w",),
        ),
        Bad(
            op,
            "w_int32",
            _set(w=torch.ones(L, LAYERS, R, H, dtype=torch.int32)),
            ("w",),
        ),
        Bad(op, "y_1d", _set(y=_poison(T * (R + 2))), ("y",)),
        Bad(op, "y_wrong_rows", _set(y=_poison(T + 1, R + 2)), ("y",)),
        Bad(op, "y_too_narrow", _set(y=_poison(T, R - 2)), ("y",)),
        Bad(
            op,
            "y_float64",
            _set(y=_poison(T, R + 2, dtype=torch.float64)),
            ("y",),
        ),
        Bad(
            op,
            "y_int64",
            _set(y=torch.zeros(T, R + 2, dtype=torch.int64)),
            ("y",),
        ),
        Bad(op, "alias_y_is_x", lambda a: a.update(y=a["x"]), ("y",)),
        Bad(
            op,
            "alias_y_in_w",
            lambda a: a.update(y=a["w"].view(-1, H)[:T]),
            ("y",),
        ),
        *_isa_entries(op),
    ]
    if low:
        entries += [
            Bad(op, "h_in_too_big", _set(h_in=H + 1), ("h_in",)),
            Bad(op, "h_in_negative", _set(h_in=-1), ("h_in",)),
            Bad(op, "h_in_not_x_columns", _set(h_in=H - 1), ("x", "h_in")),
            Bad(op, "h_out_too_big", _set(h_out=R + 1), ("h_out",)),
            Bad(op, "h_out_negative", _set(h_out=-1), ("h_out",)),
            Bad(op, "y_offset_past_end", _set(y_offset=4), ("y_offset",)),
            Bad(op, "y_offset_negative", _set(y_offset=-1), ("y_offset",)),
            Bad(
                op,
                "y_offset_overflow",
                _y_offset_overflow,
                ("y_offset",),
            ),
        ]
    return entries


def _second_slice(**changes) -> Callable[[dict], None]:
    """Replaces slice 1 of the op's weights list."""

    def mutate(a: dict) -> None:
        name = next(n for n in a if n.startswith("lora_"))
        a[name] = [a[name][0], changes[name]]

    return mutate


def _output_in_second_weights(a: dict) -> None:
    """lora_shrink's slice 0 of the output lies in the end of slice 1's
    weights (only the check across slices sees it)."""
    size = L * R * H
    storage = _nan(size + T * R)
    storage[:size] = torch.randn(size)
    a["lora_a_weights"][1] = storage[:size].view(L, R, H)
    a["output_tensor"] = storage[size - T * R :].view(2, T, R)


def _output_in_inputs(a: dict) -> None:
    """lora_expand's output shares memory with slice 1 of its inputs."""
    buffer = _randn(2, T, H)
    a["inputs"], a["output_tensor"] = buffer[:, :, :R], buffer[1]


def multi_slice_entries(op: str) -> list[Bad]:
    shrink = op == "lora_shrink"
    w_name = "lora_a_weights" if shrink else "lora_b_weights"
    stacked = "output_tensor" if shrink else "inputs"
    idx = ("token_lora_indices",)
    stacked_shape = (T, R)
    if shrink:
        w_ok = _randn(L, R, H)
        w_fewer_adapters = _randn(L - 1, R, H)
        w_other_k = _randn(L, R, H + 1)
    else:
        w_ok = _randn(L, EXPAND_SLICES[1], R)
        w_fewer_adapters = _randn(L - 1, EXPAND_SLICES[1], R)
        w_other_k = _randn(L, EXPAND_SLICES[1], R + 1)
    make = _nan if shrink else _randn
    entries = [
        Bad(
            op,
            "no_slices",
            _set(**{w_name: [], stacked: make(0, *stacked_shape)}),
            (w_name,),
        ),
        Bad(
            op,
            "stacked_slices_mismatch",
            _set(**{stacked: make(3, *stacked_shape)}),
            (stacked,),
        ),
        Bad(
            op,
            "stacked_2d",
            _set(**{stacked: make(*stacked_shape)}),
            (stacked,),
        ),
        Bad(
            op,
            "adapter_counts_differ",
            _second_slice(**{w_name: w_fewer_adapters}),
            (w_name,),
        ),
        Bad(
            op,
            "slice_k_mismatch",
            _second_slice(**{w_name: w_other_k}),
            ("inputs", w_name),
        ),
        Bad(
            op,
            "slice_float64",
            _second_slice(**{w_name: w_ok.double()}),
            (w_name,),
        ),
        Bad(op, "index_too_short", _set(token_lora_indices=_idx(0, 0, 0)), idx),
        Bad(
            op,
            "index_equal_to_num_loras",
            _set(token_lora_indices=_idx(0, L, 0, 0)),
            idx,
        ),
        Bad(
            op,
            "index_on_meta",
            _set(token_lora_indices=_idx(0, 0, 0, 0).to("meta")),
            (*idx, "Meta", "meta"),
        ),
        *_isa_entries(op),
    ]
    if shrink:
        entries += [
            Bad(
                op,
                "slice_rank_above_output",
                _second_slice(lora_a_weights=_randn(L, R + 1, H)),
                ("output_tensor",),
            ),
            Bad(
                op,
                "output_slices_share_memory",
                lambda a: a.update(
                    output_tensor=_nan(T * R + R).as_strided(
                        (2, T, R), (R, R, 1)
                    )
                ),
                ("output_tensor",),
            ),
            Bad(
                op,
                "alias_output_in_other_slice_weights",
                _output_in_second_weights,
                ("output_tensor",),
            ),
        ]
    else:
        entries += [
            Bad(
                op,
                "slices_past_output_width",
                _set(offset_start=H - sum(EXPAND_SLICES) + 1),
                ("offset_start",),
            ),
            Bad(
                op, "offset_negative", _set(offset_start=-1), ("offset_start",)
            ),
            Bad(
                op,
                "offset_past_end",
                _set(offset_start=H + 1),
                ("offset_start",),
            ),
            Bad(
                op,
                "offset_overflow",
                _set(offset_start=INT64_MAX),
                ("offset_start",),
            ),
            Bad(
                op,
                "output_wrong_rows",
                _set(output_tensor=_nan(T + 1, H)),
                ("output_tensor",),
            ),
            Bad(
                op,
                "alias_output_in_inputs",
                _output_in_inputs,
                ("output_tensor",),
            ),
        ]
    return entries


ENTRIES = (
    [e for op in VLLM_OPS for e in vllm_entries(op)]
    + [e for op in DISPATCH_OPS for e in dispatch_entries(op)]
    + [e for op in MULTI_SLICE_OPS for e in multi_slice_entries(op)]
)


# ---------------------------------------------------------------- runner --


def _snapshot(tensor: torch.Tensor) -> torch.Tensor | None:
    """Every byte of a CPU tensor's storage (None for other devices)."""
    if tensor.device.type != "cpu":
        return None
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(tensor.untyped_storage())
    return raw.clone()


def _eager_too(entry: Bad) -> bool:
    """Whether `vllm_cpu_lora.ops` must fail on the entry as torch.ops does:
    a decode or multi-slice op (whose eager fast path in _C checks the
    arguments itself) with CPU inputs (other inputs go to the reference)."""
    if entry.op not in EAGER_OPS:
        return False
    args = base_args(entry.op)
    entry.mutate(args)
    inputs = args.get("inputs")
    return isinstance(inputs, torch.Tensor) and inputs.is_cpu


EAGER_OPS = (
    "bgmv_shrink",
    "bgmv_expand",
    "bgmv_expand_slice",
    "lora_shrink",
    "lora_expand",
)


def _compiled_too(entry: Bad) -> bool:
    """Whether the entry also runs from a compiled function: the multi-slice
    ops' entries, except aliasing ones. torch.compile functionalizes the
    call, so an output that aliases another argument reaches the op as a
    fresh copy: the op cannot see the aliasing (and has nothing to reject)."""
    return entry.op in MULTI_SLICE_OPS and not entry.case.startswith("alias")


# (entry, API): every entry through torch.ops.vllm_cpu_lora, the fast-path
# ops' entries also through vllm_cpu_lora.ops, the multi-slice ops' also
# compiled.
RUNS = (
    [(e, "torch.ops") for e in ENTRIES]
    + [(e, "ops") for e in ENTRIES if _eager_too(e)]
    + [(e, "compiled") for e in ENTRIES if _compiled_too(e)]
)


def run_id(entry: Bad, api: str) -> str:
    return entry.id if api == "torch.ops" else f"{entry.id}/{api}"


def _callable(op: str, api: str):
    """The op as `api` ("torch.ops", "ops" or "compiled") calls it."""
    if api == "torch.ops":
        return getattr(torch.ops.vllm_cpu_lora, op)
    if api == "ops":
        return getattr(vllm_cpu_lora.ops, op)
    # A fresh graph per entry: each has its own shapes and devices.
    torch._dynamo.reset()
    return torch.compile(
        getattr(vllm_cpu_lora.ops, op), backend="aot_eager", fullgraph=True
    )


def run_entry(entry: Bad, api: str = "torch.ops") -> str | None:
    """Makes the bad call through `api` (see `_callable`); returns what
    was wrong with how it failed, or None if it raised RuntimeError naming
    the argument and touched nothing."""
    torch.manual_seed(0)
    args = base_args(entry.op)
    entry.mutate(args)
    tensors = [
        t
        for a in args.values()
        for t in (a if isinstance(a, list) else [a])
        if isinstance(t, torch.Tensor)
    ]
    before = [_snapshot(t) for t in tensors]
    saved = {name: os.environ.get(name) for name, _ in entry.env}
    os.environ.update(dict(entry.env))
    try:
        _callable(entry.op, api)(*args.values())
    except RuntimeError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001  (reported, not raised)
        return f"raised {type(exc).__name__} instead of RuntimeError: {exc}"
    else:
        error = None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    problems = []
    if error is None:
        problems.append("did not raise")
    else:
        # Dynamo puts its own first line above an error met while tracing.
        message = str(error)
        if api != "compiled":
            message = message.split("\n")[0]
        if not any(re.search(rf"\b{n}\b", message) for n in entry.names):
            problems.append(f"message names none of {entry.names}: {message}")
    for tensor, old in zip(tensors, before, strict=True):
        if old is not None and not torch.equal(_snapshot(tensor), old):
            problems.append("modified a tensor argument")
            break
    return "; ".join(problems) or None


def _skip_reason(entry: Bad) -> str | None:
    if entry.ub and SANITIZED:
        return "known undefined behaviour; UBSan would halt: " + entry.bug
    return None


def _param(entry: Bad, api: str):
    marks = []
    if _skip_reason(entry):
        marks.append(pytest.mark.skip(reason=_skip_reason(entry)))
    elif entry.bug:
        marks.append(pytest.mark.xfail(strict=True, reason=entry.bug))
    return pytest.param(entry, api, id=run_id(entry, api), marks=marks)


@pytest.mark.parametrize(("entry", "api"), [_param(*r) for r in RUNS])
def test_bad_call_fails_cleanly(entry, api):
    problem = run_entry(entry, api)
    assert problem is None, problem


def test_table_in_subprocess():
    """The whole table in a child process: a crash fails this test."""
    env = dict(os.environ)
    env.pop(ISA_ENV, None)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    results = {}
    started = None
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if "start" in record:
            started = record["start"]
        elif "id" in record:
            results[record["id"]] = record["problem"]
    assert proc.returncode == 0 and "done" in proc.stdout, (
        f"child exited with {proc.returncode} while running {started}:\n"
        f"{proc.stderr[-4000:]}"
    )
    unexpected = []
    for entry, api in RUNS:
        if _skip_reason(entry):
            continue
        name = run_id(entry, api)
        problem = results[name]
        if entry.bug and problem is None:
            unexpected.append(f"{name}: known bug no longer shows")
        elif not entry.bug and problem is not None:
            unexpected.append(f"{name}: {problem}")
    assert not unexpected, "\n".join(unexpected)


def test_table_covers_every_op():
    assert {e.op for e in ENTRIES} == set(
        VLLM_OPS + DISPATCH_OPS + MULTI_SLICE_OPS
    )
    assert len({e.id for e in ENTRIES}) == len(ENTRIES)
    assert {e.op for e, api in RUNS if api == "ops"} == set(EAGER_OPS)
    assert {e.op for e, api in RUNS if api == "compiled"} == set(
        MULTI_SLICE_OPS
    )


def _main() -> int:
    """Child process: runs every entry, one JSON line each."""
    for entry, api in RUNS:
        if _skip_reason(entry):
            continue
        name = run_id(entry, api)
        print(json.dumps({"start": name}), flush=True)
        print(
            json.dumps({"id": name, "problem": run_entry(entry, api)}),
            flush=True,
        )
    print(json.dumps({"done": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
