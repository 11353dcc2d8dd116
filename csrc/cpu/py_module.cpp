// The Python module object of vllm_cpu_lora._C. It has no attributes: loading
// it runs the TORCH_LIBRARY registrations of bgmv_cpu.cpp, and the ops are
// then reached through torch.ops.vllm_cpu_lora.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C",
      "Loads the torch.ops.vllm_cpu_lora C++ operators.", -1, nullptr};
  return PyModule_Create(&module_def);
}
