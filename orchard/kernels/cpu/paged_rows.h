// Paged attention on the CPU, row by row, over the pool in place (paged_rows.cpp says how).
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/utils.h"

namespace mx = mlx::core;

namespace orchard {

// Rows `query_rows` of `queries` [N, Hq, D], each over its context in the pool through its
// block table; [n, Hq, Dv] in the queries' dtype. `window` 0 and `softcap` 0 mean none.
mx::array paged_rows(const mx::array& queries, const mx::array& query_rows, const mx::array& key_cache,
                     const mx::array& value_cache, const mx::array& block_tables, const mx::array& context_lens,
                     const std::optional<mx::array>& sinks, float scale, int window, float softcap,
                     mx::StreamOrDevice s = {});

}  // namespace orchard
