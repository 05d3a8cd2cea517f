// bindings: the one pybind11 module (_C). It only exports; long calls release the GIL.
// Over 400 lines by design: the design card wants one module, and it is a flat list of exports.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend/backend.h"
#include "backend/mpi_communicator.h"
#include "common/check.h"
#include "common/logging.h"
#include "engine/engine.h"
#include "engine/engine_loop.h"
#include "engine/tp_worker.h"
#include "model/model.h"
#include "model/quant_formats.h"

namespace py = pybind11;
using namespace fantai;
using engine::Engine;
using engine::EngineConfig;
using engine::EngineLoop;
using engine::StepOutput;
using model::Model;
using model::ModelConfig;
using sampling::SamplingParams;

namespace {

// The grammar engine lives in Python (fantai.structured). The hook's worker thread takes the GIL
// only while some row of the step is constrained; the step thread itself never does.
class PyMaskProvider : public engine::TokenMaskProvider {
 public:
  explicit PyMaskProvider(py::object fill) : fill_(std::move(fill)) {}
  ~PyMaskProvider() override {
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
      py::gil_scoped_acquire gil;
      fill_ = py::object();
    } else {
      fill_.release();  // the interpreter is gone: nothing left to decrement
    }
  }
  void fill(const std::vector<engine::MaskRow>& rows, uint32_t* masks, int32_t words) override {
    py::gil_scoped_acquire gil;
    py::list ids, fed, tokens;
    for (const engine::MaskRow& r : rows) {
      ids.append(r.request_id);
      fed.append(r.num_fed);
      tokens.append(py::cast(r.new_tokens));
    }
    try {
      fill_(ids, fed, tokens, reinterpret_cast<uintptr_t>(masks), words);
    } catch (py::error_already_set& e) {
      throw std::runtime_error(std::string("token mask provider failed: ") + e.what());
    }
  }

 private:
  py::object fill_;
};

py::dict stats_dict(const engine::EngineStats& s) {
  py::dict d;
  d["num_running"] = s.num_running;
  d["num_waiting"] = s.num_waiting;
  d["num_free_blocks"] = s.num_free_blocks;
  d["num_total_blocks"] = s.num_total_blocks;
  d["num_used_blocks"] = s.num_total_blocks - s.num_free_blocks;
  py::list kinds;  // one entry per attention kind's pool (one for models without windows)
  for (const engine::KVKindStats& k : s.kv_kinds) {
    py::dict kd;
    kd["kind"] = engine::kv_kind_name(k.window);
    kd["window"] = k.window;
    kd["num_layers"] = k.num_layers;
    kd["num_total_blocks"] = k.num_total_blocks;
    kd["num_free_blocks"] = k.num_free_blocks;
    kd["num_used_blocks"] = k.num_total_blocks - k.num_free_blocks;
    kd["num_cached_blocks"] = k.num_cached_blocks;
    kd["used_slots"] = k.used_slots;
    kinds.append(kd);
  }
  d["kv_kinds"] = kinds;
  d["block_size"] = s.block_size;
  d["used_slots"] = s.used_slots;
  d["allocated_slots"] = s.allocated_slots;
  d["kv_utilization"] = s.allocated_slots ? static_cast<double>(s.used_slots) / s.allocated_slots : 0.0;
  d["num_preemptions"] = s.num_preemptions;
  d["num_swap_outs"] = s.num_swap_outs;
  d["num_swap_ins"] = s.num_swap_ins;
  d["num_swap_slots"] = s.num_swap_slots;
  d["num_free_swap_slots"] = s.num_free_swap_slots;
  d["num_swapped"] = s.num_swapped;
  d["time_swap_s"] = s.time_swap_s;
  d["num_steps"] = s.num_steps;
  d["prompt_tokens"] = s.prompt_tokens;
  d["generation_tokens"] = s.generation_tokens;
  d["last_batch_tokens"] = s.last_batch_tokens;
  d["last_batch_decode_tokens"] = s.last_batch_decode;
  d["last_batch_prefill_tokens"] = s.last_batch_prefill;
  d["num_cached_blocks"] = s.num_cached_blocks;
  d["prefix_cache_queries"] = s.prefix_queries;
  d["prefix_cache_hits"] = s.prefix_hits;
  d["prefix_cache_hit_rate"] = s.prefix_queries ? static_cast<double>(s.prefix_hits) / s.prefix_queries : 0.0;
  d["evictions"] = s.evictions;
  d["copy_on_writes"] = s.copy_on_writes;
  d["bytes_per_block"] = s.bytes_per_block;
  d["num_releases"] = s.num_releases;
  d["time_schedule_s"] = s.time_schedule_s;
  d["time_prepare_s"] = s.time_prepare_s;
  d["time_forward_s"] = s.time_forward_s;
  d["time_sample_s"] = s.time_sample_s;
  d["time_postprocess_s"] = s.time_postprocess_s;
  d["time_step_s"] = s.time_step_s;
  d["time_mask_wait_s"] = s.time_mask_wait_s;
  return d;
}

// Dashboard snapshot as plain Python data: block states as bytes (one per block, cheap to send
// for large pools), only shared blocks' ref counts, requests with their block tables.
py::dict snapshot_dict(const engine::EngineSnapshot& s) {
  py::dict d;
  d["block_states"] = py::bytes(reinterpret_cast<const char*>(s.block_states.data()), s.block_states.size());
  py::list shared;
  for (size_t b = 0; b < s.ref_counts.size(); ++b) {
    if (s.ref_counts[b] > 1) shared.append(py::make_tuple(b, s.ref_counts[b]));
  }
  d["shared"] = shared;
  py::list requests;
  for (const engine::RequestSnapshot& r : s.requests) {
    py::dict q;
    q["id"] = r.id;
    q["status"] = r.running ? "running" : r.swapped ? "swapped" : "waiting";
    q["block_table"] = r.block_table;
    q["num_tokens"] = r.num_tokens;
    q["num_prompt_tokens"] = r.num_prompt_tokens;
    q["num_computed_tokens"] = r.num_computed_tokens;
    q["num_preemptions"] = r.num_preemptions;
    requests.append(q);
  }
  d["requests"] = requests;
  d["stats"] = stats_dict(s.stats);
  return d;
}

py::list steps_list(const std::vector<engine::StepRecord>& steps) {
  py::list out;
  for (const engine::StepRecord& r : steps) {
    py::dict d;
    d["step"] = r.step;
    d["time"] = r.time;
    d["decode_tokens"] = r.decode_tokens;
    d["prefill_tokens"] = r.prefill_tokens;
    d["num_running"] = r.num_running;
    d["num_waiting"] = r.num_waiting;
    d["num_preempted"] = r.num_preempted;
    d["num_finished"] = r.num_finished;
    d["num_joined"] = r.num_joined;
    out.append(d);
  }
  return out;
}

void set_tensor(Model& m, const std::string& name, py::array array, const std::string& dtype) {
  DType src;
  if (dtype == "bfloat16") {
    FANTAI_REQUIRE(array.itemsize() == 2, "bfloat16 tensors are passed as 2-byte arrays");
    src = DType::kBF16;
  } else if (py::isinstance<py::array_t<float>>(array)) {
    src = DType::kF32;
  } else if (array.dtype().kind() == 'f' && array.itemsize() == 2) {
    src = DType::kF16;
  } else {
    FANTAI_THROW("tensor " << name << ": unsupported numpy dtype " << std::string(py::str(array.dtype())));
  }
  py::array c = py::array::ensure(array, py::array::c_style);
  std::vector<int64_t> shape(c.shape(), c.shape() + c.ndim());
  const void* data = c.data();
  py::gil_scoped_release release;
  m.weights().set(name, data, src, shape);
}

// A C-contiguous view of `obj` as T with the given rank (a copy only when obj is strided);
// a wrong dtype or rank is a ValueError, never a silent cast.
template <typename T>
py::array_t<T, py::array::c_style> typed_array(const py::object& obj, const char* what, int ndim) {
  FANTAI_REQUIRE(py::isinstance<py::array>(obj), what << " must be a numpy array");
  FANTAI_REQUIRE(py::isinstance<py::array_t<T>>(obj),
                 what << " must have dtype " << std::string(py::str(py::dtype::of<T>())) << ", got "
                      << std::string(py::str(py::reinterpret_borrow<py::array>(obj).dtype())));
  auto a = py::array_t<T, py::array::c_style>::ensure(obj);
  FANTAI_REQUIRE(a && a.ndim() == ndim, what << " must be " << ndim << "-D, got " << a.ndim() << "-D");
  return a;
}

// The arrays of a canonical quantized matrix, checked against each other, kept alive by the
// caller while the view is used.
struct QuantArrays {
  py::array_t<uint8_t, py::array::c_style> q, zero;
  py::array_t<float, py::array::c_style> scale, min;
  py::array_t<int32_t, py::array::c_style> perm;
  QuantMatrix view;
};

QuantArrays quant_arrays(const py::object& q, const py::object& scale, const py::object& zero,
                         const py::object& min, const py::object& perm, int bits, int group) {
  QuantArrays a;
  a.q = typed_array<uint8_t>(q, "q", 2);
  a.scale = typed_array<float>(scale, "scale", 2);
  QuantMatrix& v = a.view;
  v.bits = bits;
  v.rows = a.q.shape(0);
  v.cols = a.q.shape(1);
  FANTAI_REQUIRE(bits == 4 || bits == 8, "bits must be 4 or 8, got " << bits);
  FANTAI_REQUIRE(group > 0 || group == -1, "group must be positive or -1 (per channel), got " << group);
  v.group = static_cast<int32_t>(group == -1 ? v.cols : std::min<int64_t>(group, v.cols));
  v.ld = v.cols;
  const int64_t ng = v.ngroups();
  auto need_shape = [&](const py::array& x, const char* what, int64_t r, int64_t c) {
    const bool ok = x.shape(0) == r && (x.ndim() == 1 || x.shape(1) == c);
    FANTAI_REQUIRE(ok, what << " has shape (" << x.shape(0)
                            << (x.ndim() == 1 ? "" : ", " + std::to_string(x.shape(1))) << "), expected ("
                            << r << (x.ndim() == 1 ? "" : ", " + std::to_string(c)) << ")");
  };
  need_shape(a.scale, "scale", v.rows, ng);
  v.data = a.q.data();
  v.scale = a.scale.data();
  if (!zero.is_none()) {
    a.zero = typed_array<uint8_t>(zero, "zero", 2);
    need_shape(a.zero, "zero", v.rows, ng);
    v.zero = a.zero.data();
  }
  if (!min.is_none()) {
    a.min = typed_array<float>(min, "min", 2);
    need_shape(a.min, "min", v.rows, ng);
    v.min = a.min.data();
  }
  if (!perm.is_none()) {
    a.perm = typed_array<int32_t>(perm, "perm", 1);
    need_shape(a.perm, "perm", v.cols, 0);
    v.perm = a.perm.data();
  }
  return a;
}

void set_tensor_ggml(Model& m, const std::string& name, const py::object& data, int32_t ggml_type,
                     int64_t rows, int64_t cols, const py::object& row_perm) {
  auto bytes = typed_array<uint8_t>(data, "data", 1);
  py::array_t<int32_t, py::array::c_style> perm;
  if (!row_perm.is_none()) {
    perm = typed_array<int32_t>(row_perm, "row_perm", 1);
    FANTAI_REQUIRE(perm.shape(0) == rows, "row_perm has " << perm.shape(0) << " entries, expected " << rows);
  }
  const int32_t* pp = row_perm.is_none() ? nullptr : perm.data();
  const void* p = bytes.data();
  const size_t n = static_cast<size_t>(bytes.shape(0));
  py::gil_scoped_release release;
  m.weights().set_ggml(name, p, n, ggml_type, rows, cols, pp);
}

void set_tensor_quant(Model& m, const std::string& name, const py::object& q, const py::object& scale,
                      const py::object& zero, const py::object& min, const py::object& perm, int bits,
                      int group) {
  QuantArrays a = quant_arrays(q, scale, zero, min, perm, bits, group);
  const std::string format = "int" + std::to_string(bits) +
                             (a.view.group < a.view.cols ? "g" + std::to_string(a.view.group) : "");
  py::gil_scoped_release release;
  m.weights().set_quant(name, a.view, format);
}

void bind_quant(py::module_& m) {
  m.def(
      "ggml_dequantize",
      [](const py::object& data, int32_t ggml_type, int64_t rows, int64_t cols) {
        auto bytes = typed_array<uint8_t>(data, "data", 1);
        FANTAI_REQUIRE(rows > 0 && cols > 0, "bad shape (" << rows << ", " << cols << ")");
        py::array_t<float> out({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(cols)});
        const void* p = bytes.data();
        const size_t n = static_cast<size_t>(bytes.shape(0));
        float* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          model::ggml_to_f32(p, n, ggml_type, rows, cols, nullptr, o);
        }
        return out;
      },
      py::arg("data"), py::arg("ggml_type"), py::arg("rows"), py::arg("cols"));
  m.def(
      "quant_dequantize",
      [](const py::object& q, const py::object& scale, const py::object& zero, const py::object& min,
         const py::object& perm, int bits, int group) {
        QuantArrays a = quant_arrays(q, scale, zero, min, perm, bits, group);
        if (a.view.perm) {
          std::vector<char> seen(static_cast<size_t>(a.view.cols), 0);
          for (int64_t c = 0; c < a.view.cols; ++c) {
            const int32_t p = a.view.perm[c];
            FANTAI_REQUIRE(p >= 0 && p < a.view.cols && !seen[p],
                           "perm is not a permutation of [0, " << a.view.cols << ")");
            seen[p] = 1;
          }
        }
        py::array_t<float> out(
            {static_cast<py::ssize_t>(a.view.rows), static_cast<py::ssize_t>(a.view.cols)});
        float* o = out.mutable_data();
        {
          py::gil_scoped_release release;
          model::dequantize(a.view, o);
        }
        return out;
      },
      py::arg("q"), py::arg("scale"), py::arg("zero") = py::none(), py::arg("min") = py::none(),
      py::arg("perm") = py::none(), py::arg("bits") = 8, py::arg("group") = 32);
  m.def(
      "quantize_rtn",
      [](const py::object& w, int bits, int group, bool symmetric) {
        auto a = typed_array<float>(w, "w", 2);
        const int64_t rows = a.shape(0), cols = a.shape(1);
        FANTAI_REQUIRE(group == -1 || group > 0, "group must be positive or -1 (per channel), got " << group);
        model::QuantTensor t;
        {
          py::gil_scoped_release release;
          t = model::quantize_rtn(a.data(), rows, cols, bits, group, symmetric);
        }
        const int64_t ng = t.view().ngroups();
        py::array_t<uint8_t> q({rows, cols});
        py::array_t<float> scale({rows, ng});
        py::array_t<uint8_t> zero({rows, ng});
        std::copy(t.q.begin(), t.q.end(), q.mutable_data());
        std::copy(t.scale.begin(), t.scale.end(), scale.mutable_data());
        std::copy(t.zero.begin(), t.zero.end(), zero.mutable_data());
        py::dict d;
        d["q"] = q;
        d["scale"] = scale;
        d["zero"] = zero;
        return d;
      },
      py::arg("w"), py::arg("bits"), py::arg("group"), py::arg("symmetric") = true);
}

void bind_config(py::module_& m) {
  py::class_<ModelConfig>(m, "ModelConfig")
      .def_static("from_json", &ModelConfig::from_json)
      .def_static("attention_pattern_from_json", &ModelConfig::attention_pattern_from_json)
      .def_readonly("architecture", &ModelConfig::architecture)
      .def_readonly("vocab_size", &ModelConfig::vocab_size)
      .def_readonly("hidden_size", &ModelConfig::hidden_size)
      .def_readonly("num_layers", &ModelConfig::num_layers)
      .def_readonly("num_heads", &ModelConfig::num_heads)
      .def_readonly("num_kv_heads", &ModelConfig::num_kv_heads)
      .def_readonly("head_dim", &ModelConfig::head_dim)
      .def_readonly("max_position_embeddings", &ModelConfig::max_position_embeddings)
      .def_readonly("eos_token_ids", &ModelConfig::eos_token_ids)
      .def_readonly("sliding_window", &ModelConfig::sliding_window)
      .def_readonly("layer_window", &ModelConfig::layer_window)
      .def_readonly("attn_logit_softcap", &ModelConfig::attn_logit_softcap)
      .def_readonly("final_logit_softcap", &ModelConfig::final_logit_softcap)
      .def_readonly("query_pre_attn_scalar", &ModelConfig::query_pre_attn_scalar)
      .def("summary", &ModelConfig::summary);

  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init<>())
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_readwrite("presence_penalty", &SamplingParams::presence_penalty)
      .def_readwrite("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("max_tokens", &SamplingParams::max_tokens)
      .def_readwrite("min_tokens", &SamplingParams::min_tokens)
      .def_readwrite("ignore_eos", &SamplingParams::ignore_eos)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("logprobs", &SamplingParams::logprobs)
      .def_readwrite("logit_bias", &SamplingParams::logit_bias)
      .def_readwrite("constrained", &SamplingParams::constrained);

  py::class_<EngineConfig>(m, "EngineConfig")
      .def(py::init<>())
      .def_readwrite("block_size", &EngineConfig::block_size)
      .def_readwrite("num_blocks", &EngineConfig::num_blocks)
      .def_readwrite("kv_cache_bytes", &EngineConfig::kv_cache_bytes)
      .def_readwrite("max_num_seqs", &EngineConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &EngineConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &EngineConfig::max_model_len)
      .def_readwrite("enable_chunked_prefill", &EngineConfig::enable_chunked_prefill)
      .def_readwrite("seed", &EngineConfig::seed)
      .def_readwrite("eos_token_ids", &EngineConfig::eos_token_ids)
      .def_readwrite("kv_cache_dtype", &EngineConfig::kv_cache_dtype)
      .def_readwrite("enable_prefix_caching", &EngineConfig::enable_prefix_caching)
      .def_readwrite("release_keep_cached_blocks", &EngineConfig::release_keep_cached_blocks)
      .def_readwrite("swap_space_bytes", &EngineConfig::swap_space_bytes)
      .def_readwrite("preemption_mode", &EngineConfig::preemption_mode);
}

void bind_model(py::module_& m) {
  py::class_<Model, std::shared_ptr<Model>>(m, "Model")
      .def_static(
          "from_pretrained",
          [](const std::string& dir, const std::string& dtype, const std::string& backend, int threads,
             const std::string& quantization) {
            auto be = create_backend(backend, threads);
            py::gil_scoped_release release;
            return Model::from_pretrained(dir, dtype, be, quantization);
          },
          py::arg("path"), py::arg("dtype") = "auto", py::arg("backend") = "cpu", py::arg("threads") = 0,
          py::arg("quantization") = "none")
      .def_static(
          "create",
          [](const std::string& config_json, const std::string& dtype, const std::string& backend,
             int threads, const std::string& quantization) {
            ModelConfig c = ModelConfig::from_json(config_json);
            DType dt = dtype == "auto" ? c.torch_dtype : dtype_from_name(dtype);
            return std::make_shared<Model>(c, dt, create_backend(backend, threads), quantization);
          },
          py::arg("config_json"), py::arg("dtype") = "auto", py::arg("backend") = "cpu",
          py::arg("threads") = 0, py::arg("quantization") = "none")
      .def("set_tensor", &set_tensor, py::arg("name"), py::arg("array"), py::arg("dtype") = "")
      .def("set_tensor_ggml", &set_tensor_ggml, py::arg("name"), py::arg("data"), py::arg("ggml_type"),
           py::arg("rows"), py::arg("cols"), py::arg("row_perm") = py::none())
      .def("set_tensor_quant", &set_tensor_quant, py::arg("name"), py::arg("q"), py::arg("scale"),
           py::arg("zero") = py::none(), py::arg("min") = py::none(), py::arg("perm") = py::none(),
           py::arg("bits") = 4, py::arg("group") = 128)
      .def("weight_formats", [](Model& mo) { return mo.weights().formats(); })
      .def("finalize", &Model::finalize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("config", &Model::config)
      .def_property_readonly("dtype", [](const Model& mo) { return std::string(dtype_name(mo.dtype())); })
      .def_property_readonly("num_threads", [](const Model& mo) { return mo.backend()->num_threads(); })
      .def_property_readonly("backend", [](const Model& mo) { return mo.backend()->name(); })
      .def(
          "bind_threads",
          [](Model& mo, const std::string& spec, int offset) {
            return mo.backend()->bind_threads(spec, offset);
          },
          py::arg("spec"), py::arg("offset") = 0)
      .def(
          "set_matmul_precision",
          [](Model& mo, const std::string& precision) {
            return mo.backend()->set_matmul_precision(dtype_from_name(precision));
          },
          py::arg("precision"))
      .def_property_readonly("device_free_memory",
                             [](const Model& mo) { return mo.backend()->free_memory(); })
      .def("weight_bytes", [](Model& mo) { return mo.weights().total_bytes(); })
      .def("lm_head_bytes", [](Model& mo) { return mo.weights().lm_head_bytes(); })
      .def_property_readonly("lm_head_seconds", &Model::lm_head_seconds)
      .def_property_readonly("lm_head_calls", &Model::lm_head_calls)
      .def("quant_bytes", [](Model& mo) { return mo.weights().quant_bytes(); })
      .def(
          "score",
          [](Model& mo, const std::vector<int32_t>& ids, const std::string& kv_cache_dtype) {
            const DType kv = dtype_from_name(kv_cache_dtype);
            std::vector<float> logits;
            {
              py::gil_scoped_release release;
              logits = mo.score(ids, kv);
            }
            py::array_t<float> out(
                {static_cast<py::ssize_t>(ids.size()), static_cast<py::ssize_t>(mo.config().vocab_size)});
            std::copy(logits.begin(), logits.end(), out.mutable_data());
            return out;
          },
          py::arg("ids"), py::arg("kv_cache_dtype") = "float32");
}

void bind_engine(py::module_& m) {
  py::class_<engine::TokenLogprob>(m, "TokenLogprob")
      .def_readonly("logprob", &engine::TokenLogprob::logprob)
      .def_readonly("top", &engine::TokenLogprob::top);
  py::class_<StepOutput>(m, "StepOutput")
      .def_readonly("request_id", &StepOutput::request_id)
      .def_readonly("token_ids", &StepOutput::token_ids)
      .def_readonly("logprobs", &StepOutput::logprobs)
      .def_readonly("finished", &StepOutput::finished)
      .def_property_readonly(
          "finish_reason",
          [](const StepOutput& o) { return std::string(engine::finish_reason_name(o.finish_reason)); })
      .def_readonly("stop_token_id", &StepOutput::stop_token_id)
      .def_readonly("num_prompt_tokens", &StepOutput::num_prompt_tokens)
      .def_readonly("num_output_tokens", &StepOutput::num_output_tokens)
      .def_readonly("queue_seconds", &StepOutput::queue_seconds);

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init([](std::shared_ptr<Model> model, const EngineConfig& c) {
        py::gil_scoped_release release;
        return std::make_shared<Engine>(std::move(model), c);
      }))
      .def("add_request", &Engine::add_request, py::arg("id"), py::arg("prompt"), py::arg("params"),
           py::arg("siblings") = std::vector<std::pair<uint64_t, SamplingParams>>{})
      .def("abort_request", &Engine::abort_request)
      .def(
          "set_mask_provider",
          [](Engine& e, py::object fill) {
            e.set_mask_provider(std::make_shared<PyMaskProvider>(std::move(fill)));
          },
          py::arg("fill"))
      .def("reset_prefix_cache", &Engine::reset_prefix_cache)
      .def("release_memory", &Engine::release_memory, py::call_guard<py::gil_scoped_release>())
      .def("abort_all", &Engine::abort_all)
      .def("step", &Engine::step, py::call_guard<py::gil_scoped_release>())
      .def("has_unfinished", &Engine::has_unfinished)
      .def("stats", [](const Engine& e) { return stats_dict(e.stats()); })
      .def("snapshot", [](const Engine& e) { return snapshot_dict(e.snapshot()); })
      .def_property_readonly("max_model_len", [](const Engine& e) { return e.config().max_model_len; })
      .def_property_readonly("max_num_batched_tokens",
                             [](const Engine& e) { return e.config().max_num_batched_tokens; })
      .def_property_readonly("kv_cache_bytes", &Engine::kv_cache_bytes)
      .def("kv_resident_bytes", &Engine::kv_resident_bytes)
      .def("swap_resident_bytes", &Engine::swap_resident_bytes)
      .def_property_readonly("num_blocks", [](const Engine& e) { return e.block_manager().num_blocks(); })
      .def_property_readonly("block_size", [](const Engine& e) { return e.block_manager().block_size(); });

  py::class_<EngineLoop, std::shared_ptr<EngineLoop>>(m, "EngineLoop")
      .def(py::init<std::shared_ptr<Engine>>())
      .def("start", &EngineLoop::start)
      .def("stop", &EngineLoop::stop, py::call_guard<py::gil_scoped_release>())
      .def("add_request", &EngineLoop::add_request, py::arg("id"), py::arg("prompt"), py::arg("params"),
           py::arg("siblings") = std::vector<std::pair<uint64_t, SamplingParams>>{})
      .def("abort_request", &EngineLoop::abort_request)
      .def("reset_prefix_cache", &EngineLoop::reset_prefix_cache)
      .def("kv_resident_bytes", &EngineLoop::kv_resident_bytes)
      .def("release_memory", &EngineLoop::release_memory)
      .def("set_idle_release", &EngineLoop::set_idle_release)
      .def("wait_outputs", &EngineLoop::wait_outputs, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const EngineLoop& l) { return stats_dict(l.stats()); })
      .def("last_error", &EngineLoop::last_error)
      .def("fault", &EngineLoop::fault)
      .def("snapshot",
           [](EngineLoop& l) -> py::object {
             std::shared_ptr<const engine::EngineSnapshot> s = l.snapshot();
             if (!s) return py::none();
             return snapshot_dict(*s);
           })
      .def(
          "steps_since", [](const EngineLoop& l, int64_t after) { return steps_list(l.steps_since(after)); },
          py::arg("after") = -1)
      .def("set_snapshot_interval", &EngineLoop::set_snapshot_interval);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fantai core: paged KV cache, continuous batching and the model forward pass";
  bind_config(m);
  bind_model(m);
  bind_quant(m);
  bind_engine(m);
  // Tensor parallelism: the process's communicator is set before any backend is made.
  m.def("mpi_unavailable_reason", &mpi_unavailable_reason);
  // "" when CUDA devices can be joined over NCCL (tensor parallelism on GPU ranks), else why not.
  m.def("nccl_unavailable_reason", &nccl_unavailable_reason);
  // {"nccl": {...}, "cublaslt": {...}}: opens each if not yet (a CUDA build loads them on first
  // use, not at import) and gives path, version (ncclGetVersion, cublasLtGetVersion: no GPU
  // needed) and error ("" when usable).
  m.def("cuda_library_versions", [] {
    py::dict out;
    for (const RuntimeLibrary& r : cuda_runtime_libraries()) {
      py::dict d;
      d["path"] = r.path;
      d["version"] = r.version;
      d["error"] = r.error;
      out[py::str(r.name)] = d;
    }
    return out;
  });
  m.def("tp_world_rank", &mpi_world_rank);
  m.def(
      "tp_connect",
      [](int world_size, const std::vector<std::string>& worker_argv, double timeout_s) {
        auto comm = mpi_connect(world_size, worker_argv, timeout_s);
        set_process_communicator(comm);
        return comm->rank();
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "tp_join",
      [](double timeout_s) {
        auto comm = mpi_join(timeout_s);
        set_process_communicator(comm);
        return comm->rank();
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("tp_reset", [] { set_process_communicator(nullptr); });
  // A clean stop of this process: rank 0 stops its group's loop (when an engine did not), then
  // every group is disconnected and MPI finalized (see mpi_finalize); false when not.
  m.def(
      "tp_finalize",
      [](double timeout_s) {
        if (auto c = process_communicator()) engine::tp_stop_group(*c);
        return mpi_finalize(timeout_s);
      },
      py::arg("timeout_s") = 5.0, py::call_guard<py::gil_scoped_release>());
  m.def("tp_worker_loop", &engine::run_tp_worker, py::call_guard<py::gil_scoped_release>());
  m.def("tp_stats", [] {
    const CommStats s = process_communicator()->stats();
    py::dict d;
    d["rank"] = process_communicator()->rank();
    d["world_size"] = process_communicator()->world_size();
    d["all_reduce_calls"] = s.all_reduce_calls;
    d["all_reduce_bytes"] = s.all_reduce_bytes;
    d["gather_calls"] = s.gather_calls;
    d["gather_bytes"] = s.gather_bytes;
    d["seconds"] = s.seconds;
    return d;
  });
  m.def("cpu_isa", &host_cpu_isa);
  m.def("cpu_isa_levels", &host_cpu_isa_levels);
  m.def("default_threads", &host_default_threads);
  m.def("available_backends", &available_backends);
  m.def("default_kv_cache_bytes", &engine::default_kv_cache_bytes);
  m.def("set_log_level", [](const std::string& level) {
    LogLevel l = level == "debug"     ? LogLevel::kDebug
                 : level == "warning" ? LogLevel::kWarning
                 : level == "error"   ? LogLevel::kError
                 : level == "off"     ? LogLevel::kOff
                                      : LogLevel::kInfo;
    set_log_level(l);
  });
}
