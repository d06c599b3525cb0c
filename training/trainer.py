"""The jitted, mesh-sharded Medusa train step (Medusa-1: frozen backbone; Medusa-2: joint); its state and batch
kinds are in docs/modules.md."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from medusa_jax.model import sharding as shd
from medusa_jax.model.backbone import CausalLM, with_layer_execution
from medusa_jax.model.config import LayerExecution, resolve_dtype
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.settings import above, at_least, check_settings, setting
from medusa_jax.training import losses
from medusa_jax.training.objectives import LossSettings, objective_for

HEAD_LOSSES = ("ce", "kl", "ce+kl")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = setting(1e-3, above(0.0))  # peak LR of the backbone (Medusa-2); the heads' is
    head_lr_multiplier: float = setting(1.0, above(0.0))  # learning_rate * head_lr_multiplier
    warmup_steps: int = setting(50, at_least(0))
    max_steps: int = setting(1000, at_least(1))  # length of the cosine schedule
    weight_decay: float = setting(0.0, at_least(0.0))
    clip_norm: float = setting(1.0, at_least(0.0))  # global gradient norm clip (0 = off)
    loss_decay: float = setting(0.8, above(0.0))  # head i's loss weight is loss_decay**i
    medusa2: bool = False  # train the backbone jointly
    lm_loss_weight: float = setting(1.0, at_least(0.0))  # Medusa-2: weight of the base model's objective
    distill_kl: bool = False  # Medusa-2 on self-distilled data: KL to the frozen original instead of LM loss
    compute_dtype: str = "float32"
    freeze_head_lm_heads: bool = False  # train only the ResBlocks; each head's lm_head keeps its initial value
    head_loss: str = "ce"  # ce (data tokens) | kl (the base's distribution, see losses.py) | ce+kl
    ce_weight: float = setting(1.0, at_least(0.0))  # weight of each head's CE in ce+kl
    kl_weight: float = setting(1.0, at_least(0.0))  # weight of each head's KL in kl and ce+kl
    # EAGLE drafter (training/eagle_loss.py): uniform noise on the input features, and the weights of the
    # feature regression and of the cross-entropy against the base's distribution
    eagle_noise: float = setting(0.1, at_least(0.0))
    eagle_feature_weight: float = setting(1.0, at_least(0.0))
    eagle_ce_weight: float = setting(0.1, at_least(0.0))
    eagle_train_depth: int = setting(1, at_least(1))  # > 1: also train depths 2..N on the drafter's own outputs
    layers: LayerExecution = LayerExecution()  # the backbone's layers in the step: scan, remat, attention kernel
    # tokens per chunk of the heads' and Medusa-2's LM loss: one chunk's logits live at a time (training/
    # chunked_loss.py; exact); 0 = whole rows
    loss_chunk: int = setting(0, at_least(0))
    optimizer_dtype: str = "float32"  # storage dtype of Adam's moments (bfloat16 halves them; updated in float32)

    def __post_init__(self):
        check_settings(self)
        resolve_dtype(self.compute_dtype)
        if self.head_loss not in HEAD_LOSSES:
            raise ValueError(f"head_loss must be one of {HEAD_LOSSES}, got {self.head_loss!r}")
        if self.distill_kl and not self.medusa2:
            raise ValueError("--distill-kl trains the backbone: it needs --medusa2")
        if self.head_loss_weights == (0.0, 0.0):
            raise ValueError(f"--head-loss {self.head_loss}: its weights (--ce-weight/--kl-weight) are all 0; make "
                             f"one > 0")
        if self.optimizer_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"optimizer_dtype must be float32 or bfloat16, got {self.optimizer_dtype!r}")
        if self.eagle_feature_weight + self.eagle_ce_weight == 0:
            raise ValueError("--eagle-feature-weight and --eagle-ce-weight are both 0: nothing to train; make one > 0")

    @property
    def head_loss_weights(self) -> tuple[float, float]:
        """(CE weight, KL weight) of each head's loss."""
        return {"ce": (self.ce_weight, 0.0), "kl": (0.0, self.kl_weight),
                "ce+kl": (self.ce_weight, self.kl_weight)}[self.head_loss]

    @property
    def uses_teacher(self) -> bool:
        return self.head_loss != "ce"


def schedule(peak: float, config: TrainConfig) -> optax.Schedule:
    warmup = min(config.warmup_steps, config.max_steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(config.max_steps, warmup + 1), peak * 0.01)


def stored_in(inner: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """`inner` with its floating-point state stored in `dtype` between steps, updated in float32 within one."""
    if dtype == "float32":
        return inner

    def init(params):
        return cast_floating(inner.init(params), resolve_dtype(dtype))

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast_floating(state, jnp.float32), params)
        return updates, cast_floating(state, resolve_dtype(dtype))

    return optax.GradientTransformation(init, update)


# ---- the update of stacked layers ([L, ...] parameters) one layer at a time in a fori_loop, so XLA's temporaries
# are one layer's; the global-norm clip is applied per slice (docs/modules.md) -------------------------------------
def clip_by(t: jax.Array, grad_norm: jax.Array, max_norm: float | None) -> jax.Array:
    """`t` clipped by the global norm of all gradients, as optax.clip_by_global_norm (max_norm None: as is)."""
    if max_norm is None:
        return t
    return jax.lax.select(jnp.squeeze(grad_norm < max_norm), t, (t / grad_norm.astype(t.dtype)) * max_norm)


def clipped(inner: optax.GradientTransformation, max_norm: float | None) -> optax.GradientTransformationExtraArgs:
    """`inner` after the global-norm clip of its gradients (the norm is update's `grad_norm=`)."""
    def update(updates, state, params=None, *, grad_norm=None, **_):
        return inner.update(jax.tree.map(lambda t: clip_by(t, grad_norm, max_norm), updates), state, params)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def layer_by_layer(inner: optax.GradientTransformation,
                   max_norm: float | None) -> optax.GradientTransformationExtraArgs:
    """`clipped(inner, max_norm)` over stacked parameters, one layer at a time. `inner` must update each leaf
    from that leaf alone (Adam, AdamW: elementwise); its state's leaves are either stacked like the parameters
    (moments) or scalars (step counts), which every layer's update advances alike and which are kept once."""
    def update(updates, state, params=None, *, grad_norm=None, **_):
        leaves = jax.tree.leaves(updates)
        if not leaves:
            return updates, state

        def layer(tree, i):
            return jax.tree.map(lambda x: x if x.ndim == 0 else jax.lax.dynamic_index_in_dim(x, i, keepdims=False),
                                tree)

        def put(tree, layer_tree, i):
            return jax.tree.map(lambda x, y: y.astype(x.dtype) if x.ndim == 0 else
                                jax.lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), i, 0), tree, layer_tree)

        def body(i, carry):
            grads, new_state = carry
            grads_i = jax.tree.map(lambda t: clip_by(t, grad_norm, max_norm), layer(grads, i))
            # layer i of the carry is still the state before the update (the update is in place); scalars (step
            # counts) come from the state before the update: each layer advances them once
            state_i = jax.tree.map(lambda x, old: old if x.ndim == 0 else x, new_state, state)
            updates_i, state_i = inner.update(grads_i, layer(state_i, i),
                                              None if params is None else layer(params, i))
            return put(grads, updates_i, i), put(new_state, state_i, i)

        return jax.lax.fori_loop(0, leaves[0].shape[0], body, (updates, state))

    return optax.GradientTransformationExtraArgs(inner.init, update)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW + warmup/cosine after a global-norm clip, heads at learning_rate * head_lr_multiplier, moments in
    config.optimizer_dtype; stacked 16-bit layers updated one at a time (layer_by_layer)."""
    max_norm = config.clip_norm if config.clip_norm > 0 else None
    # stacked layers' 16-bit moments: optax's whole-leaf update kept float32 temporaries of every layer (75.6 GiB
    # per device in the 70B Medusa-2 plan on 16 GPUs, 67.2 layer by layer); float32 moments it updates in place,
    # where the loop's carry cost copies (8B Medusa-2 on 8 GPUs: 25.0 GiB whole-leaf, 27.4 layer by layer)
    by_layer = config.layers.scan and config.optimizer_dtype != "float32"

    def adamw(peak):
        return stored_in(optax.adamw(schedule(peak, config), b1=0.9, b2=0.999, weight_decay=config.weight_decay),
                         config.optimizer_dtype)

    def label(name, path):
        if name == "base" and by_layer and _path_keys(path)[:1] == ("layers",):
            return "layers"
        return name

    def labels(params):
        return {name: jax.tree_util.tree_map_with_path(lambda path, _: label(name, path), tree)
                for name, tree in params.items()}

    transforms = {"heads": clipped(adamw(config.learning_rate * config.head_lr_multiplier), max_norm),
                  "base": clipped(adamw(config.learning_rate), max_norm)}
    if by_layer:
        transforms["layers"] = layer_by_layer(adamw(config.learning_rate), max_norm)
    return optax.multi_transform(transforms, labels)


def _path_keys(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return tuple(out)


def shardings_like_params(tree, param_shardings, mesh: Mesh):
    """Shardings for an optimiser state: a leaf whose path ends with a parameter's path (Adam's mu/nu) takes
    that parameter's sharding; anything else (step counts) is replicated."""
    by_path = {_path_keys(p): s for p, s in jax.tree_util.tree_leaves_with_path(param_shardings)}

    def one(path, _):
        keys = _path_keys(path)
        for start in range(len(keys)):
            if keys[start:] in by_path:
                return by_path[keys[start:]]
        return shd.replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, tree)


def cast_floating(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _compute_graphdef(module: nnx.Module, make, dtype: str):
    """The module's graph definition with its compute dtype set to `dtype` (parameters cast on the fly)."""
    if dtype == module.config.dtype:
        return nnx.split(module)[0]
    return nnx.split(nnx.eval_shape(lambda: make(dataclasses.replace(module.config, dtype=dtype))))[0]


class Trainer:
    """Holds the sharded train state and the jitted step/eval functions."""

    def __init__(self, base: CausalLM, heads: MedusaHeads, config: TrainConfig, mesh: Mesh, abstract: bool = False):
        """`abstract`: base and heads come from `nnx.eval_shape`; the state is shapes and shardings only
        (jax.ShapeDtypeStruct), nothing is allocated, and only `jitted_step(...).lower` is usable
        (medusa_jax.training.plan)."""
        self.config, self.mesh = config, mesh
        shd.validate_model_mesh(base.config, mesh)
        self.objective = objective_for(heads.config.head_type)
        if config.medusa2 and not self.objective.joint_backbone:
            raise ValueError(f"{heads.config.head_type} heads train with a frozen backbone (Medusa-1) only; drop "
                             f"--medusa2")
        dtype = config.compute_dtype
        self._given_layers = base.config.execution  # base() returns the backbone in the form it was given
        base = with_layer_execution(base, config.layers)  # layers stacked for the scan (model/layer_stack.py)
        self._base_def = _compute_graphdef(base, lambda c: CausalLM(c, nnx.Rngs(0)), dtype)
        self._heads_def = _compute_graphdef(heads, lambda c: type(heads)(c, nnx.Rngs(0)), dtype)
        trainable = nnx.Param
        if config.freeze_head_lm_heads:
            trainable = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("lm_head")))
        self._stored_heads_def, heads_params, heads_rest = nnx.split(heads, trainable, ...)
        self._stored_base_def, base_state = nnx.split(base)
        params = {"heads": heads_params}
        frozen: dict[str, Any] = {"heads_rest": heads_rest}
        if config.medusa2:
            params["base"] = base_state
            if config.distill_kl:
                frozen["reference"] = base_state if abstract else jax.tree.map(jnp.copy, base_state)
        else:
            frozen["base"] = base_state
        self.param_shardings = {k: shd.param_shardings(v, mesh) for k, v in params.items()}
        self.frozen_shardings = {k: shd.param_shardings(v, mesh) for k, v in frozen.items()}
        self.optimizer = make_optimizer(config)
        if abstract:
            self.params, self.frozen = _abstract(params, self.param_shardings), _abstract(frozen, self.frozen_shardings)
        else:  # fresh buffers: the step donates them, and init_heads may share one array between heads
            self.params = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), params),
                                         self.param_shardings)
            self.frozen = jax.device_put(frozen, self.frozen_shardings)
        abstract_opt = jax.eval_shape(self.optimizer.init, self.params)
        self.opt_shardings = shardings_like_params(abstract_opt, self.param_shardings, mesh)
        self.opt_state = _abstract(abstract_opt, self.opt_shardings) if abstract else jax.jit(
            self.optimizer.init, out_shardings=self.opt_shardings)(self.params)
        self.step = 0
        self._jitted: dict[tuple[str, str], Any] = {}  # (step or eval, batch kind): the jitted function

    # ---- the pure functions -----------------------------------------------------------------------
    def _modules(self, params, frozen):
        dtype = resolve_dtype(self.config.compute_dtype)
        base_state = params["base"] if self.config.medusa2 else frozen["base"]
        cast_state = cast_floating(base_state, dtype)
        if self.config.layers.scan:  # the stacked layers are cast one layer at a time, inside the scan
            cast_state["layers"] = base_state["layers"]
        base = nnx.merge(self._base_def, cast_state)
        heads = nnx.merge(self._heads_def, cast_floating(params["heads"], dtype),
                          cast_floating(frozen["heads_rest"], dtype))
        return base, heads

    def _objective(self, params, frozen, batch, full_vocab_targets: bool = False):
        """The loss and its statistics: the heads' kind's objective (training.objectives); full_vocab_targets
        (evaluation): an EAGLE drafter is scored against the base's greedy token over the full vocabulary,
        without input noise."""
        base, heads = self._modules(params, frozen)
        dtype = resolve_dtype(self.config.compute_dtype)
        settings = LossSettings(self.config, full_vocab_targets,
                                lambda: nnx.merge(self._base_def, cast_floating(frozen["reference"], dtype)))
        loss, stats, extras = self.objective.loss(base, heads, batch, settings)
        return loss, (stats, extras)

    def _train_step(self, params, opt_state, frozen, batch):
        (loss, (stats, extras)), grads = jax.value_and_grad(self._objective, has_aux=True)(params, frozen, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.optimizer.update(grads, opt_state, params, grad_norm=grad_norm)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "stats": stats, **extras}
        return params, opt_state, metrics

    # ---- sharded entry points ---------------------------------------------------------------------
    def _batch_shardings(self, batch: dict[str, np.ndarray]):
        return {k: shd.checked_sharding(self.mesh, shd.batch_sharding(self.mesh, v.ndim).spec,
                                        (v.shape[0] * jax.process_count(), *v.shape[1:]),
                                        f"batch array {k!r} (rows over data x fsdp)")
                for k, v in batch.items()}

    def device_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays sharded over (data, fsdp)."""
        sh = self._batch_shardings(batch)
        return {k: jax.make_array_from_process_local_data(sh[k], np.asarray(v)) for k, v in batch.items()}

    def _under_mesh(self, fn):
        """fn traced under the mesh's axes, so the model's sharding constraints apply (rows over data x fsdp,
        one layer's weights gathered over fsdp at a time: medusa_jax.model.sharding)."""
        def traced(*args):
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                return fn(*args)

        return traced

    def _compiled(self, what: str, batch, build):
        key = (what, batch_kind(batch))
        if key not in self._jitted:
            self._jitted[key] = build(self._batch_shardings(batch))
        return self._jitted[key]

    def jitted_step(self, batch) -> Any:
        """The jitted train step (params, opt_state, frozen, batch) for batches shaped like `batch` (arrays or
        jax.ShapeDtypeStructs: this process's rows)."""
        rep = shd.replicated(self.mesh)
        return self._compiled("step", batch, lambda bsh: jax.jit(
            self._under_mesh(self._train_step), in_shardings=(self.param_shardings, self.opt_shardings,
                                                              self.frozen_shardings, bsh),
            out_shardings=(self.param_shardings, self.opt_shardings, rep), donate_argnums=(0, 1)))

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One optimiser step on this process's share of a global batch. Returns host metrics."""
        step = self.jitted_step(batch)
        self.params, self.opt_state, metrics = step(self.params, self.opt_state, self.frozen, self.device_batch(batch))
        self.step += 1
        return jax.device_get(metrics)

    def eval_stats(self, batch: dict[str, np.ndarray]) -> tuple[losses.HeadStats, dict]:
        evaluation = lambda params, frozen, b: self._objective(params, frozen, b, full_vocab_targets=True)[1]
        fn = self._compiled("eval", batch, lambda bsh: jax.jit(
            self._under_mesh(evaluation), in_shardings=(self.param_shardings, self.frozen_shardings, bsh),
            out_shardings=shd.replicated(self.mesh)))
        return jax.device_get(fn(self.params, self.frozen, self.device_batch(batch)))

    # ---- results ----------------------------------------------------------------------------------
    def heads(self) -> MedusaHeads:
        """The trained heads (stored dtype) on the host's default device."""
        params, rest = jax.device_get((self.params["heads"], self.frozen["heads_rest"]))
        return nnx.merge(self._stored_heads_def, _to_device(params), _to_device(rest))

    def base(self) -> CausalLM:
        """The backbone (trained in Medusa-2, the original in Medusa-1) on the host's default device."""
        state = jax.device_get(self.params["base"] if self.config.medusa2 else self.frozen["base"])
        return with_layer_execution(nnx.merge(self._stored_base_def, _to_device(state)), self._given_layers)


def batch_kind(batch) -> str:
    """"hidden" (cached hidden states), "features" (packed rows with their features) or "rows"."""
    return "hidden" if "hidden" in batch else "features" if "feat" in batch else "rows"


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _to_device(tree):
    return jax.tree.map(jnp.asarray, tree)
