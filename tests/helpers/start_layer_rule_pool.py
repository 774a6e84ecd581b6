"""NOT SGLang: a minimal class that reproduces the API of the SGLang 0.5.12 line's DeepSeek-V4
pool that the plugin replaces, `get_cached_swa_loc(raw_loc, layer_id)` with its "translate when
layer_id == start_layer, else reuse" rule. That SGLang line cannot be installed beside this
project's torch on a CPU, so the adapter is tested against this replica of its signature and rule.
"""

import torch


class StartLayerRulePool:
    def __init__(self, mapping: torch.Tensor, start_layer: int = 0):
        self.full_to_swa_index_mapping = mapping
        self.start_layer = start_layer
        self.cached_loc = None

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[kv_indices]

    def get_cached_swa_loc(self, raw_loc: torch.Tensor, layer_id: int) -> torch.Tensor:
        if layer_id == self.start_layer or self.cached_loc is None:
            self.cached_loc = self.translate_loc_from_full_to_swa(raw_loc)
        return self.cached_loc
