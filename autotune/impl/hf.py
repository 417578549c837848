"""The Hugging Face `transformers` code a trial runs (the `hf` implementation of autotune/impl/).
Configs and the specs they give are autotune/models/hf_config.py.

Checkpointing the first k decoder layers: transformers' own mechanism
(`activation_checkpointing_enable`), then the per-layer flag off on layers k..L-1:
GradientCheckpointingLayer reads `self.gradient_checkpointing` on every call. The same lines are
what `autotune export` prints; `checkpoint_first_layers` is the one call for users.
"""

from __future__ import annotations

from autotune.errors import SpecError
from autotune.models import ModelSpec
from autotune.models.hf_config import config_object, decoder_layers

# ---- the code a trial runs ----------------------------------------------------------------------


def checkpoint_first_layers(model, k: int) -> None:
    """Recompute the activations of the first `k` decoder layers of a Hugging Face model in
    backward, keep those of the others: transformers' own checkpointing (non-reentrant
    torch.utils.checkpoint), then each later layer's flag off. k = 0 turns checkpointing off."""
    layers = decoder_layers(model)
    if not isinstance(k, int) or not 0 <= k <= len(layers):
        raise SpecError(f"checkpoint_first_layers: k must be 0..{len(layers)}, got {k!r}")
    if k == 0:
        if model.is_activation_checkpointing:
            model.activation_checkpointing_disable()
        return
    model.activation_checkpointing_enable({"use_reentrant": False})
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < k


VOCAB_PARALLEL_LOSS = "autotune_vocab_parallel_loss"
"""A config attribute the memory model sets on one tensor-parallel rank's shard of a tied model
(memory/tensor_parallel.py): its loss is DeepSpeed's vocabulary-parallel cross entropy, as AutoTP installs it."""


def _vocab_parallel_loss(model, vocab_size: int) -> None:
    """DeepSpeed's vocabulary-parallel causal-LM loss on `model`, as engine._apply_autotp_partitioning installs it
    for a tied, vocabulary-sharded head (sequence/cross_entropy.py configure_vocab_parallel_loss ->
    VocabParallelCausalLMLoss.__call__ -> vocab_parallel_cross_entropy, reduction mean): the same tensors, without
    its tp group (no all-reduce) and without its target-range check, whose .item() a fake-tensor trace cannot run."""
    from deepspeed.sequence.cross_entropy import _VocabParallelCrossEntropy

    def loss_function(logits, labels=None, vocab_size=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        shift_labels = labels[..., 1:].contiguous()
        logits = logits[..., :-1, :].contiguous()
        loss = _VocabParallelCrossEntropy.apply(logits, shift_labels, None, 0, vocab_size_, -100)
        valid_tokens = (shift_labels != -100).sum().to(dtype=loss.dtype)
        return loss.sum() / valid_tokens.clamp_min(1)

    vocab_size_ = vocab_size
    model.loss_function = loss_function


class HfImpl:
    """`hf`: AutoModelForCausalLM.from_config, random init by the model's own _init_weights."""

    name = "hf"

    def build(self, spec: ModelSpec, *, dtype, attention: str, num_layers: int | None = None):
        from transformers import AutoModelForCausalLM

        config = config_object(spec, num_layers)
        # A training run: no KV cache (transformers turns it off itself under checkpointing).
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
        built = len(decoder_layers(model)) if num_layers else 0  # (0: the blockless program of costops)
        if built != (num_layers or 0):
            # Nemotron-H: the depth is the length of its per-layer list, which num_hidden_layers does not set
            raise SpecError(
                f"{type(model).__name__}: num_hidden_layers {num_layers} built "
                f"{built} decoder layers; autotune traces a model of fewer layers "
                "than it has by setting num_hidden_layers, which this config does not follow"
            )
        if getattr(config, VOCAB_PARALLEL_LOSS, False):
            _vocab_parallel_loss(model, config.vocab_size)
        return model.train()  # from_config's model is in eval mode: the config's dropout is real here

    def layers(self, model) -> list:
        return decoder_layers(model)

    def loss(self, model, tokens):
        # The Trainer's way: labels = input_ids, the model shifts them (ForCausalLMLoss, fp32 logits).
        x = tokens[:, :-1]
        return model(input_ids=x, labels=x).loss

    def checkpoint_first(self, model, k: int) -> None:
        checkpoint_first_layers(model, k)
