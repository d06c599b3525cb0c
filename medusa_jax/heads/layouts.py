"""The one table of heads tensor and file names, per folder layout: what `heads.export` writes and
`heads.load` reads (the layouts: docs/interop.md, docs/modules.md). h = head, l = ResBlock layer.

  layout      ResBlock weight / bias                        lm_head of head h       truncated-vocab map
  medusa      {h}.{l}.linear.weight / .bias                 {h}.{num_layers}.weight  (none: expanded)
  vllm        blocks.{h}.layers.{l}.weight / .bias          lm_heads.{h}.weight      token_map
  medusa-jax  heads.{h}.blocks.{l}.linear.kernel / .bias    heads.{h}.lm_head.kernel token_map

medusa and vllm store PyTorch's [out, in] layout; medusa-jax (`heads.folder`) stores the NNX parameters as they
are ([in, out] kernels), named by their NNX paths.
"""

from __future__ import annotations

import dataclasses
import re

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_WEIGHTS_PT = "medusa_lm_head.pt"
VLLM_WEIGHTS = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorNames:
    """Format strings of one layout's tensor names (fields {h}, {l}, {num_layers})."""

    block_weight: str
    block_bias: str
    lm_head: str
    token_map: str | None = None
    head_index_re: str = ""  # a regex whose group 1 is the head index of a per-head name (for error hints)

    def weight(self, h: int, l: int) -> str:
        return self.block_weight.format(h=h, l=l)

    def bias(self, h: int, l: int) -> str:
        return self.block_bias.format(h=h, l=l)

    def lm(self, h: int, num_layers: int = 0) -> str:
        return self.lm_head.format(h=h, num_layers=num_layers)

    def lm_re(self, num_layers: int = 0) -> str:
        """A regex matching the lm_head name of any head."""
        return re.escape(self.lm_head.format(h="HEAD", num_layers=num_layers)).replace("HEAD", r"\d+")


MEDUSA = TensorNames("{h}.{l}.linear.weight", "{h}.{l}.linear.bias", "{h}.{num_layers}.weight",
                     head_index_re=r"(\d+)\.")
VLLM = TensorNames("blocks.{h}.layers.{l}.weight", "blocks.{h}.layers.{l}.bias", "lm_heads.{h}.weight",
                   token_map="token_map", head_index_re=r"(?:blocks|lm_heads)\.(\d+)\.")
VLLM_SHARED_LM_HEAD = "lm_head.weight"  # vLLM also reads a shared (original_lm_head) lm_head under this name
NATIVE = TensorNames("heads.{h}.blocks.{l}.linear.kernel", "heads.{h}.blocks.{l}.linear.bias",
                     "heads.{h}.lm_head.kernel", token_map="token_map")
