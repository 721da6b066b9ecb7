// The MLP's gated activation on the CPU (activations.cpp says why).
#pragma once

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace orchard {

// silu(gate) * up of `gate_up` [rows, 2 * intermediate], whose first `intermediate` columns are the
// gate and the rest the up projection; [rows, intermediate] float32. float32 input only.
mx::array swiglu(const mx::array& gate_up, int intermediate, mx::StreamOrDevice s = {});

}  // namespace orchard
