// The Python module vllm_cpu_lora._C. Loading it runs the TORCH_LIBRARY
// registrations of bgmv_cpu.cpp; the ops are reached through
// torch.ops.vllm_cpu_lora.
//
// It also holds the eager fast path that vllm_cpu_lora.ops takes for the
// decode ops. A torch.ops call from Python costs ~1.4 us before the kernel
// starts (arguments matched to the schema as IValues, then the boxed
// dispatcher), which is most of a one-token decode call. Where the
// dispatcher would have nothing to do but reach the CPU kernel, these
// functions call the kernel directly and return True; otherwise they return
// False, touching nothing, and the caller goes through torch.ops. Kernel,
// argument checks and errors are the same either way; the call still shows
// in the profiler under the op's name.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <Python.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/util/SmallVector.h>

#include <initializer_list>

#include "call_counts.h"
#include "ops.h"

namespace vllm_cpu_lora {
namespace {

// The tensor of a Python argument that the dispatcher would hand straight to
// the CPU kernel, or nullptr: not a torch.Tensor or Parameter (a subclass may
// override __torch_function__), a torch function mode on, a dispatch key
// beyond the CPU backend's plain ones (a Python mode, functionalization, a
// fake or non-CPU tensor, a conjugate/negative view), or autograd to record.
const at::Tensor* PlainCpu(PyObject* obj) {
  if (!THPVariable_CheckExact(obj) || at::impl::torch_function_mode_enabled()) {
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  static const c10::DispatchKeySet kPlain(
      {c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
       c10::DispatchKey::ADInplaceOrView, c10::DispatchKey::AutocastCPU,
       c10::DispatchKey::BackendSelect});
  const auto tls = c10::impl::tls_local_dispatch_key_set();
  const auto keys = (t.key_set() | tls.included_) - tls.excluded_;
  if (!kPlain.isSupersetOf(keys)) return nullptr;
  if (t.requires_grad() && at::GradMode::is_enabled()) return nullptr;
  return &t;
}

// Releases the GIL for the kernel, as torch.ops does, when the call has
// enough work for that to matter to other Python threads: releasing and
// taking it back costs ~0.2 us, a third of a one-token call. Work is the
// multiply-adds of the product, inputs [T, K] against weights [L, N, K].
class GilRelease {
 public:
  GilRelease(const at::Tensor& inputs, const at::Tensor& weights) {
    constexpr double kMinWork = 1 << 20;  // ~10 us of kernel time.
    // In double: the sizes are not checked yet, and may be absurd.
    const double rows = weights.dim() >= 2 ? weights.size(-2) : 1;
    if (static_cast<double>(inputs.numel()) * rows >= kMinWork) {
      state_ = PyEval_SaveThread();
    }
  }
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

// Every decode op starts with inputs, weights, output and indices.
constexpr int kTensors = 4;

// Checks the argument count and unpacks the first kTensors arguments as
// plain CPU tensors; false if any is not one (with a TypeError pending for a
// wrong count).
bool UnpackTensors(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want,
                   const char* op, const at::Tensor* (&t)[kTensors]) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", op, want,
                 nargs);
    return false;
  }
  for (int i = 0; i < kTensors; ++i) {
    t[i] = PlainCpu(args[i]);
    if (t[i] == nullptr) return false;
  }
  return true;
}

// The answer when the call is left to torch.ops: False, or the error set
// while looking at the arguments.
PyObject* Declined() {
  if (PyErr_Occurred()) return nullptr;
  Py_RETURN_FALSE;
}

// Runs the op `name` through `kernel` on tensors t: the GIL released for
// large calls and the call recorded for the profiler, as the dispatcher
// would. Returns True.
template <class Kernel>
PyObject* Run(const char* name, const at::Tensor* const (&t)[kTensors],
              Kernel&& kernel) {
  {
    GilRelease no_gil(*t[0], *t[1]);
    RECORD_FUNCTION(name,
                    std::vector<c10::IValue>({*t[0], *t[1], *t[2], *t[3]}));
    kernel();
  }
  Py_RETURN_TRUE;
}

PyObject* EagerBgmvShrink(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const at::Tensor* t[kTensors];
  if (!UnpackTensors(args, nargs, 5, "bgmv_shrink", t) ||
      !(PyFloat_CheckExact(args[4]) || PyLong_CheckExact(args[4]))) {
    return Declined();
  }
  const double scaling = PyFloat_AsDouble(args[4]);
  if (PyErr_Occurred()) return nullptr;
  return Run("vllm_cpu_lora::bgmv_shrink", t,
             [&] { BgmvShrink(*t[0], *t[1], *t[2], *t[3], scaling); });
  END_HANDLE_TH_ERRORS
}

PyObject* EagerBgmvExpand(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const at::Tensor* t[kTensors];
  if (!UnpackTensors(args, nargs, 5, "bgmv_expand", t) ||
      !PyBool_Check(args[4])) {
    return Declined();
  }
  const bool add_inputs = args[4] == Py_True;
  return Run("vllm_cpu_lora::bgmv_expand", t,
             [&] { BgmvExpand(*t[0], *t[1], *t[2], *t[3], add_inputs); });
  END_HANDLE_TH_ERRORS
}

PyObject* EagerBgmvExpandSlice(PyObject*, PyObject* const* args,
                               Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const at::Tensor* t[kTensors];
  if (!UnpackTensors(args, nargs, 7, "bgmv_expand_slice", t) ||
      !PyLong_CheckExact(args[4]) || !PyLong_CheckExact(args[5]) ||
      !PyBool_Check(args[6])) {
    return Declined();
  }
  const int64_t slice_offset = PyLong_AsLongLong(args[4]);
  const int64_t slice_size = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  const bool add_inputs = args[6] == Py_True;
  return Run("vllm_cpu_lora::bgmv_expand_slice", t, [&] {
    BgmvExpandSlice(*t[0], *t[1], *t[2], *t[3], slice_offset, slice_size,
                    add_inputs);
  });
  END_HANDLE_TH_ERRORS
}

// A multi-slice op's weights: a list or tuple of plain CPU tensors, else
// false.
bool UnpackSlices(PyObject* obj, c10::SmallVector<at::Tensor, 3>* slices) {
  if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const at::Tensor* t = PlainCpu(items[i]);
    if (t == nullptr) return false;
    slices->push_back(*t);
  }
  return true;
}

// Checks the argument count and unpacks a multi-slice op's tensors: inputs,
// the weights list, output and indices; false if any is not plain CPU.
bool UnpackMultiSlice(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want,
                      const char* op, const at::Tensor* (&t)[3],
                      c10::SmallVector<at::Tensor, 3>* slices) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", op, want,
                 nargs);
    return false;
  }
  t[0] = PlainCpu(args[0]);
  t[1] = PlainCpu(args[2]);
  t[2] = PlainCpu(args[3]);
  return t[0] != nullptr && t[1] != nullptr && t[2] != nullptr &&
         UnpackSlices(args[1], slices);
}

// Runs a multi-slice op as Run does: the GIL released for large calls, the
// call recorded for the profiler.
template <class Kernel>
PyObject* RunMultiSlice(const char* name, const at::Tensor* const (&t)[3],
                        c10::ArrayRef<at::Tensor> slices, Kernel&& kernel) {
  {
    // Work as for one slice's weights: the GIL threshold is coarse anyway.
    GilRelease no_gil(*t[0], slices.empty() ? *t[0] : slices[0]);
    RECORD_FUNCTION(name, std::vector<c10::IValue>({*t[0], *t[1], *t[2]}));
    kernel();
  }
  Py_RETURN_TRUE;
}

PyObject* EagerLoraShrink(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const at::Tensor* t[3];
  c10::SmallVector<at::Tensor, 3> slices;
  if (!UnpackMultiSlice(args, nargs, 5, "lora_shrink", t, &slices) ||
      !(PyFloat_CheckExact(args[4]) || PyLong_CheckExact(args[4]))) {
    return Declined();
  }
  const double scaling = PyFloat_AsDouble(args[4]);
  if (PyErr_Occurred()) return nullptr;
  return RunMultiSlice("vllm_cpu_lora::lora_shrink", t, slices, [&] {
    LoraShrink(*t[0], slices, *t[1], *t[2], scaling);
  });
  END_HANDLE_TH_ERRORS
}

PyObject* EagerLoraExpand(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const at::Tensor* t[3];
  c10::SmallVector<at::Tensor, 3> slices;
  if (!UnpackMultiSlice(args, nargs, 6, "lora_expand", t, &slices) ||
      !PyLong_CheckExact(args[4]) || !PyBool_Check(args[5])) {
    return Declined();
  }
  const int64_t offset_start = PyLong_AsLongLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  const bool add_inputs = args[5] == Py_True;
  return RunMultiSlice("vllm_cpu_lora::lora_expand", t, slices, [&] {
    LoraExpand(*t[0], slices, *t[1], *t[2], offset_start, add_inputs);
  });
  END_HANDLE_TH_ERRORS
}

// {op name: calls} of the ops called at least once in this process.
PyObject* CallCounts(PyObject*, PyObject*) {
  PyObject* counts = PyDict_New();
  if (counts == nullptr) return nullptr;
  for (int i = 0; i < static_cast<int>(OpName::kNumOps); ++i) {
    const auto op = static_cast<OpName>(i);
    const int64_t n = CallCount(op);
    if (n == 0) continue;
    PyObject* value = PyLong_FromLongLong(n);
    const int failed = value == nullptr ||
                       PyDict_SetItemString(counts, OpNameString(op), value);
    Py_XDECREF(value);
    if (failed) {
      Py_DECREF(counts);
      return nullptr;
    }
  }
  return counts;
}

PyObject* ResetCounts(PyObject*, PyObject*) {
  ResetCallCounts();
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"eager_bgmv_shrink", reinterpret_cast<PyCFunction>(EagerBgmvShrink),
     METH_FASTCALL,
     "bgmv_shrink straight to the CPU kernel; False if torch.ops must "
     "dispatch it."},
    {"eager_bgmv_expand", reinterpret_cast<PyCFunction>(EagerBgmvExpand),
     METH_FASTCALL,
     "bgmv_expand straight to the CPU kernel; False if torch.ops must "
     "dispatch it."},
    {"eager_bgmv_expand_slice",
     reinterpret_cast<PyCFunction>(EagerBgmvExpandSlice), METH_FASTCALL,
     "bgmv_expand_slice straight to the CPU kernel; False if torch.ops must "
     "dispatch it."},
    {"eager_lora_shrink", reinterpret_cast<PyCFunction>(EagerLoraShrink),
     METH_FASTCALL,
     "lora_shrink straight to the CPU kernel; False if torch.ops must "
     "dispatch it."},
    {"eager_lora_expand", reinterpret_cast<PyCFunction>(EagerLoraExpand),
     METH_FASTCALL,
     "lora_expand straight to the CPU kernel; False if torch.ops must "
     "dispatch it."},
    {"call_counts", CallCounts, METH_NOARGS,
     "{op name: calls} of the ops called at least once in this process."},
    {"reset_call_counts", ResetCounts, METH_NOARGS,
     "Sets every op's call count back to 0."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace vllm_cpu_lora

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C",
      "Loads the torch.ops.vllm_cpu_lora C++ operators; eager fast path of "
      "vllm_cpu_lora.ops.",
      -1, vllm_cpu_lora::kMethods};
  return PyModule_Create(&module_def);
}
