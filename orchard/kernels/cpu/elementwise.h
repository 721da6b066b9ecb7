// Elementwise ops of a layer on the CPU, bit for bit what MLX's CPU ops compute (elementwise.cpp says why).
#pragma once

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace orchard {

// silu(gate) * up of `gate_up` [rows, 2 * intermediate], whose first `intermediate` columns are the
// gate and the rest the up projection; [rows, intermediate] float32. float32 input only.
mx::array swiglu(const mx::array& gate_up, int intermediate, mx::StreamOrDevice s = {});

// Rotary embedding of `x` [T, ..., D] by per-row tables `cos`, `sin` [T, D / 2] (non-traditional: the
// halves of each row rotate together): [x1 * cos - x2 * sin, x2 * cos + x1 * sin]. float32 only.
mx::array rotate_rows(const mx::array& x, const mx::array& cos, const mx::array& sin, mx::StreamOrDevice s = {});

}  // namespace orchard
