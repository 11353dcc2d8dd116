// The bgmv and multi-slice ops as C++ functions, for the eager fast path of
// py_module.cpp (the same functions the dispatcher calls for
// torch.ops.vllm_cpu_lora).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace vllm_cpu_lora {

void BgmvShrink(const at::Tensor& inputs, const at::Tensor& lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, double scaling);

void BgmvExpand(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& lora_indices_tensor, bool add_inputs);

void BgmvExpandSlice(const at::Tensor& inputs, const at::Tensor& lora_b_weights,
                     const at::Tensor& output_tensor,
                     const at::Tensor& lora_indices_tensor,
                     int64_t slice_offset, int64_t slice_size, bool add_inputs);

void LoraShrink(const at::Tensor& inputs, at::TensorList lora_a_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& token_lora_indices, double scaling);

void LoraExpand(const at::Tensor& inputs, at::TensorList lora_b_weights,
                const at::Tensor& output_tensor,
                const at::Tensor& token_lora_indices, int64_t offset_start,
                bool add_inputs);

}  // namespace vllm_cpu_lora
