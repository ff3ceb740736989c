// Makes the extension importable as the Python module vllm_lite._C: importing it loads the
// shared library, which runs the op registrations in torch_bindings.cpp. It also exposes
// the CPU ISA selection (cpu/cpu_isa.h) and packed_linear's panel width and kernels. Only
// the extension target (vllm_lite_python) compiles this file; the library vllm_lite_kernels
// links the same kernel objects without Python.
#include <Python.h>

#include <c10/util/Exception.h>

#include "cpu/cpu_isa.h"
#include "cpu/packed_linear_params.h"
#include "moe_limits.h"
#include "ops.h"

namespace {

PyObject* py_cpu_isas(PyObject*, PyObject*) {
  const auto names = vllm_lite::cpu::cpu_isas();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(names.size()));
  for (size_t i = 0; i < names.size(); ++i) {
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyUnicode_FromString(names[i].c_str()));
  }
  return list;
}

PyObject* py_cpu_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(vllm_lite::cpu::cpu_isa().c_str());
}

PyObject* py_set_cpu_isa(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  try {
    vllm_lite::cpu::set_cpu_isa(name);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// "float32" / "bfloat16" -> whether packed_linear runs its own kernel for that dtype.
PyObject* py_packed_linear_kernel(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  const std::string dtype(name);
  if (dtype != "float32" && dtype != "bfloat16") {
    PyErr_SetString(PyExc_ValueError, "dtype must be 'float32' or 'bfloat16'");
    return nullptr;
  }
  return PyBool_FromLong(vllm_lite::cpu::packed_linear_kernel_selected(
      dtype == "float32" ? at::kFloat : at::kBFloat16));
}

// Whether int8_linear / int4_linear have a kernel for a packed qweight in the selected build.
PyObject* py_packed_quant_linear_kernel(PyObject*, PyObject*) {
  return PyBool_FromLong(vllm_lite::cpu::packed_quant_linear_kernel_selected());
}

PyMethodDef methods[] = {
    {"cpu_isas", py_cpu_isas, METH_NOARGS,
     "The builds of the CPU attention kernel this CPU can run, widest first."},
    {"cpu_isa", py_cpu_isa, METH_NOARGS, "The build of the CPU attention kernel in use."},
    {"set_cpu_isa", py_set_cpu_isa, METH_O, "Selects a build of the CPU attention kernel."},
    {"packed_linear_kernel", py_packed_linear_kernel, METH_O,
     "Whether packed_linear has a kernel for 'float32' / 'bfloat16' in the selected build."},
    {"packed_quant_linear_kernel", py_packed_quant_linear_kernel, METH_NOARGS,
     "Whether int8_linear / int4_linear run a packed qweight's kernel in the selected build."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&module);
  // pack_linear_weight's panel width, for the op's fake (shape-only) implementation.
  if (m != nullptr &&
      (PyModule_AddIntConstant(m, "PACKED_PANEL_COLS", vllm_lite::cpu::kPackedPanelCols) < 0 ||
       // fused_moe's limits (moe_limits.h), which layers/moe.py applies to a model's config.
       PyModule_AddIntConstant(m, "MOE_MAX_NUM_EXPERTS", vllm_lite::kMoeMaxNumExperts) < 0 ||
       PyModule_AddIntConstant(m, "MOE_MAX_TOP_K", vllm_lite::kMoeMaxTopK) < 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
