// Python bindings of the CPU kernels (module orchard.kernels.cpu._paged_cpu).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>

#include "elementwise.h"
#include "paged_rows.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_paged_cpu, m) {
  m.doc() = "CPU kernels: paged attention reading the KV pool in place; the elementwise ops of a layer";
  m.def("paged_rows", &orchard::paged_rows, "queries"_a, "query_rows"_a, "key_cache"_a, "value_cache"_a,
        "block_tables"_a, "context_lens"_a, "sinks"_a = nb::none(), nb::kw_only(), "scale"_a, "window"_a = 0,
        "softcap"_a = 0.0f, "stream"_a = nb::none(),
        "Rows `query_rows` of `queries` [N, Hq, D] over their paged contexts; [n, Hq, Dv] in the queries' dtype.");
  m.def("swiglu", &orchard::swiglu, "gate_up"_a, "intermediate"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up of `gate_up` [rows, 2 * intermediate] (gate first), float32, as MLX's CPU ops compute it.");
  m.def("rotate_rows", &orchard::rotate_rows, "x"_a, "cos"_a, "sin"_a, nb::kw_only(), "stream"_a = nb::none(),
        "[x1 * cos - x2 * sin, x2 * cos + x1 * sin] of `x` [T, ..., D] by tables [T, D / 2], float32.");
}
