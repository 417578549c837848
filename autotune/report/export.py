"""`autotune export`: the winning (or a chosen) trial's DeepSpeed JSON, and how to use it.

The JSON is `deepspeed_config(cfg, model, cluster, ...)`, the same function every trial ran with, so
what was measured is what is exported: by default in its "trainer" style ("auto" where the Hugging Face Trainer
fills the value from its TrainingArguments), with `style="concrete"` the numbers a trial ran (a plain
deepspeed.initialize loop), and with `into` merged into a user's own DeepSpeed config (only the tuned keys change).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.deepspeed_config import (
    MISSING,
    OPTIMIZER_IMPLS,
    PRECISION_FLAGS,
    STYLES,
    TRAINER_FILLED,
    TUNED_KEYS,
    config_changes,
    deepspeed_config,
    default_optimizer_impl,
    leaves,
    trainer_arguments,
)
from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.models.hf_config import default_attention
from autotune.report import objective
from autotune.search import study as st
from autotune.train_config import TrainConfig


def pick_trial(study: optuna.Study, number: int | None = None) -> FrozenTrial:
    """The fastest successful run, or trial `number`, which must have run successfully."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if number is None:
        if not done:
            raise SpecError(
                f"study {study.study_name!r} has no successful run to export yet "
                f"(`autotune report --study {study.study_name}` shows why)"
            )
        return max(done, key=lambda t: (t.value, -t.number))
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    if number not in trials:
        raise SpecError(f"study {study.study_name!r} has no trial {number} (trials 0..{len(trials) - 1})")
    t = trials[number]
    if t.state != TrialState.COMPLETE:
        r = st.record_of(t)
        why = r.reason or r.status
        ok = ", ".join(str(d.number) for d in sorted(done, key=lambda d: -d.value)[:5])
        raise SpecError(
            f"trial {number} did not run successfully ({t.state.name.lower()}: {why}); "
            f"export a completed one{' (fastest: ' + ok + ')' if ok else ''}"
        )
    return t


def export(
    study: optuna.Study,
    out: Path | None,
    number: int | None = None,
    accelerate_config: Path | None = None,
    *,
    into: Path | None = None,
    style: str = "trainer",
) -> tuple[FrozenTrial, TrainConfig, str]:
    """Write the DeepSpeed JSON of the chosen trial to `out` (and, given `accelerate_config`, an
    `accelerate launch` config file that points at it); return the trial, its config, and usage text.

    `style`: deepspeed_config's ("trainer": "auto" where the Hugging Face Trainer fills the value; "concrete": the
    numbers, for a plain deepspeed.initialize loop). `into`: a user's DeepSpeed config JSON, kept but for the keys
    autotune tuned (deepspeed_config's `base`); the result goes to `out`, by default back into `into`."""
    if style not in STYLES:
        raise SpecError(f"export style {style!r}: one of {', '.join(STYLES)}")
    if out is None and into is None:
        raise SpecError("export needs --out FILE, or --into YOUR_DS_CONFIG.json to update your own config")
    user = read_user_config(Path(into)) if into is not None else None
    out = Path(out if out is not None else into)
    trial = pick_trial(study, number)
    model, cluster, _ = st.specs_of(study)
    record = st.record_of(trial)
    cfg = record.config
    # the optimizer code the trial ran (FusedAdam, or torch's fused AdamW where FusedAdam could not be built): the
    # same JSON as the trial's, through the same function; a study from before it was recorded gets the default
    impl = (record.result.optimizer_impl if record.result else "") or default_optimizer_impl(cfg, cluster)
    ds = deepspeed_config(cfg, model, cluster, impl, style=style, base=user)
    # every output is made first, then written whole or not at all (write_all)
    files = [(out, json.dumps(ds, indent=2) + "\n")]
    source = record.source or "measured"
    head = (
        f"wrote {out}: trial {trial.number} of study {study.study_name} ({cfg.short()}), "
        f"{speed_text(record, trial.value, objective(study))} ({source}, model code {model.code_name})"
        f"\noptimizer: {OPTIMIZER_IMPLS[impl]}"
        + ("" if record.result and record.result.optimizer_impl else " (the default: the trial did not record its own)")
    )
    if user is not None:
        head += "\n" + "\n".join(into_lines(Path(into), out, user, ds, cfg))
    if cfg.method != "full":
        lora_path = lora_config_path(out)
        files.append((lora_path, lora_config_json(model, cfg)))
        head += f"\nwrote {lora_path}: its peft LoraConfig"
    if accelerate_config is not None:
        accelerate_config = Path(accelerate_config)
        files.append((accelerate_config, accelerate_config_yaml(cfg, cluster, out, accelerate_config)))
        head += f"\nwrote {accelerate_config}: an `accelerate launch` config that starts DeepSpeed with it"
    write_all(files)
    return trial, cfg, head + "\n\n" + usage(cfg, model, cluster, out, accelerate_config, style=style, ds=ds)


def read_user_config(path: Path) -> dict:
    """A user's DeepSpeed config JSON (`--into`): a JSON object, else SpecError."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"--into {path}: no such file (give your DeepSpeed config JSON)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"--into {path}: cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"--into {path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SpecError(f"--into {path}: a DeepSpeed config is a JSON object, not {type(data).__name__}")
    return data


def _is_tuned(path: str) -> bool:
    return any(path == k or path.startswith(k + ".") for k in TUNED_KEYS)


def _fmt(v: object) -> str:
    return MISSING if v is MISSING else json.dumps(v)


def into_lines(into: Path, out: Path, user: dict, ds: dict, cfg: TrainConfig) -> list[str]:
    """What `--into` did to the user's config: each tuned key changed (old -> new), each of the user's keys that
    conflicted with the tuned configuration (removed or switched off, and why), what was filled in, what was kept."""
    changes = config_changes(user, ds)
    order = {k: i for i, k in enumerate(TUNED_KEYS)}
    tuned = sorted(
        (c for c in changes if _is_tuned(c[0])),
        key=lambda c: min(i for k, i in order.items() if c[0] == k or c[0].startswith(k + ".")),
    )
    other = [c for c in changes if not _is_tuned(c[0])]
    where = "updated in place" if out.resolve() == into.resolve() else f"written to {out}, {into} untouched"
    lines = [
        f"--into {into}: your config kept, {where}; {len(tuned)} tuned value(s) changed (old -> new):",
    ]
    for path, old, new in tuned:
        why = ""
        if new is MISSING:
            why = "  (removed: the tuned configuration runs without it; the measured memory and speed are without it)"
        elif path in PRECISION_FLAGS and new is False:
            why = f"  (switched off: the tuned configuration runs {cfg.precision})"
        elif new == "auto":
            why = "  (the Trainer fills it from TrainingArguments: the tuned value is printed below)"
        elif path == "optimizer.type":
            why = "  (the trials measured AdamW's memory and speed; your lr, betas, eps, weight decay are kept)"
        lines.append(f"  {path}: {_fmt(old)} -> {_fmt(new)}{why}")
    for path, old, new in other:
        if old is MISSING:
            lines.append(f"  added (your config had none): {path}: {_fmt(new)}")
        elif new is MISSING:
            lines.append(f"  removed: {path}: {_fmt(old)}  (your optimizer section gave way to the tuned one)")
        else:  # concrete style: DeepSpeed resolves no "auto"
            lines.append(f'  {path}: {_fmt(old)} -> {_fmt(new)}  (DeepSpeed resolves no "auto": autotune\'s value)')
    kept = [p for p in leaves(user) if p in leaves(ds) and leaves(ds)[p] == leaves(user)[p] and not _is_tuned(p)]
    if kept:
        lines.append(
            f"  kept as you wrote them: {len(kept)} other key(s) ({', '.join(kept[:8])}{', ...' if len(kept) > 8 else ''})"
        )
    return lines


def speed_text(record: st.TrialRecord, value: float, objective: str) -> str:
    """The trial's throughput, each number with its unit: both samples/s and tokens/s where the run recorded both,
    the study's objective (the value it ranked by) first."""
    res = record.result
    both = {
        "samples": res.samples_per_s if res else None,
        "tokens": res.tokens_per_s if res else None,
    }
    both[objective] = value
    first, other = objective, "tokens" if objective == "samples" else "samples"

    def fmt(v: float) -> str:  # as the report's table writes numbers
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"

    text = f"{fmt(both[first])} {first}/s"
    if both[other]:
        text += f" and {fmt(both[other])} {other}/s"
    return text + f" (ranked by {objective}/s)"


def _target_problem(path: Path) -> str | None:
    """Why `path` cannot be written as a file, checking only (nothing is created); None when it can."""
    if path.is_dir():
        return "is a directory; give a file path"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folders that would be made: the nearest one that exists must take them
    if not parent.is_dir():
        return f"cannot be made: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be written: no permission to write in {parent}"
    if path.exists() and not os.access(path, os.W_OK):
        return "cannot be written: the file exists and is read-only"
    return None


def write_all(files: list[tuple[Path, str]]) -> None:
    """Write every file or none: each target checked first (SpecError naming each that cannot be written), then
    each written to a temporary beside it and all renamed in place at the end; a write that fails removes the
    temporaries, leaving every target as it was (and the folders made for them)."""
    problems = [f"{p} {why}" for p, _ in files if (why := _target_problem(p)) is not None]
    paths = [p.resolve() for p, _ in files]
    if len(set(paths)) < len(paths):
        problems.append("two outputs are the same file: " + ", ".join(str(p) for p, _ in files))
    if problems:
        raise SpecError("export wrote nothing: " + "; ".join(problems))
    done: list[tuple[Path, Path]] = []
    try:
        for path, text in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            with open(tmp, "x") as f:  # "x": never another file's name; the mode is the umask's, as a plain write
                done.append((tmp, path))
                f.write(text)
    except OSError as e:
        for tmp, _ in done:
            tmp.unlink(missing_ok=True)
        raise SpecError(f"export wrote nothing: {e.filename or path}: {e.strerror or e}") from None
    for tmp, path in done:
        os.replace(tmp, path)


def lora_config_path(ds_path: Path) -> Path:
    """Where the peft LoraConfig goes: beside the DeepSpeed JSON, `<stem>.lora.json`."""
    return ds_path.with_name(ds_path.stem + ".lora.json")


def lora_config_json(model: ModelSpec, cfg: TrainConfig) -> str:
    """The LoraConfig the trials ran (autotune/impl/lora.py), as JSON: `peft.LoraConfig(**json.load(f))`
    accepts it. The attention targets are named from the model's own decoder layers (meta device)."""
    import torch

    from autotune.impl import impl_for
    from autotune.impl.lora import lora_config_dict, target_modules

    base = impl_for(model)
    depth = 1 if model.uniform_blocks else None  # a stack of mixed layers: all of them
    with torch.device("meta"):
        layers = base.layers(
            base.build(model, dtype=torch.bfloat16, attention=default_attention(model), num_layers=depth)
        )
    return json.dumps(lora_config_dict(cfg, target_modules(cfg, layers)), indent=2) + "\n"


def _lora_lines(cfg: TrainConfig, path: Path) -> list[str]:
    """How the trials applied the adapters, for the Trainer + peft."""
    if cfg.method == "full":
        return []
    lines = [
        f"LoRA ({cfg.method}, rank {cfg.lora_rank}, targets {cfg.lora_targets}): the trials ran peft on the "
        "model before the Trainer:",
        "  import json; from peft import LoraConfig, get_peft_model",
    ]
    if cfg.method == "qlora":
        lines += [
            "  from transformers import BitsAndBytesConfig",
            '  bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", '
            f"bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.{'float16' if cfg.precision == 'fp16' else 'bfloat16'})",
            "  model = AutoModelForCausalLM.from_pretrained(NAME, quantization_config=bnb)",
            "  (estimated and simulated only: autotune runs no 4-bit trial without a GPU)",
        ]
    lines += [
        f'  model = get_peft_model(model, LoraConfig(**json.load(open("{lora_config_path(path)}"))), '
        "autocast_adapter_dtype=False)"
    ]
    if cfg.ckpt_layers:
        lines.append(
            "  model.enable_input_require_grads()  # with checkpointing: the frozen embedding's output needs grad"
        )
    lines.append("  Trainer(model=model, args=TrainingArguments(deepspeed=..., as above), train_dataset=...).train()")
    return lines


def json_path_for_yaml(ds_path: Path, yaml_path: Path | None) -> str:
    """The JSON's path as the accelerate YAML names it: relative to the YAML's folder (by default the current one),
    so the two files move together (to a cluster, another checkout). accelerate 1.16 passes the string on as it is
    (commands/launch.py _validate_launch_command copies it onto args.deepspeed_config_file, utils/launch.py
    prepare_deepspeed_cmd_env exports it as ACCELERATE_DEEPSPEED_CONFIG_FILE) and each rank opens it from its working
    directory (utils/dataclasses.py DeepSpeedPlugin.__post_init__ -> HfDeepSpeedConfig): it resolves against the
    folder `accelerate launch` runs in, not the YAML's, so the printed usage says to launch in the YAML's folder."""
    folder = (Path(yaml_path).resolve().parent if yaml_path is not None else Path.cwd()).resolve()
    return Path(os.path.relpath(Path(ds_path).resolve(), folder)).as_posix()


def accelerate_config_yaml(cfg: TrainConfig, cluster: Cluster, ds_path: Path, yaml_path: Path | None = None) -> str:
    """An `accelerate launch --config_file` YAML (accelerate/commands/config/config_args.py ClusterConfig), to be
    written at `yaml_path`, that starts the exported JSON with DeepSpeed on `cluster`; why each key is (or is not)
    there, with the accelerate 1.16 sources: docs/measurements/report.md, "Export: the accelerate config file"."""
    import yaml

    # relative to the YAML's folder (json_path_for_yaml); zero3_init_flag: the model built under
    # deepspeed.zero.Init, as the trials built it; no mixed_precision key: accelerate refuses one beside a
    # deepspeed_config_file (commands/launch.py ACCELERATE_CONFIG_DS_FIELDS), the JSON's bf16 / fp16 decides
    rel = json_path_for_yaml(ds_path, yaml_path)
    ds: dict = {"deepspeed_config_file": rel, "zero3_init_flag": cfg.zero_stage == 3}
    conf: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": ds,
        "num_machines": cluster.num_nodes,
        "num_processes": cluster.world_size,
        "machine_rank": 0,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "use_cpu": cluster.gpu.is_cpu,
        "debug": False,
    }
    if cluster.num_nodes > 1:  # torchrun's launcher; main_process_ip and machine_rank are the user's to fill in
        ds["deepspeed_multinode_launcher"] = "standard"
        conf.update(main_process_ip="MAIN_NODE_IP", main_process_port=29500)
    if cfg.sequence_parallel_size > 1:
        conf["parallelism_config"] = parallelism_config_yaml(cfg, cluster)
    prec = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[cfg.precision]
    head = (
        f"# autotune export: {cfg.short()} on {cluster.world_size} ranks"
        + (f", tensor parallel {cfg.autotp_size}" if cfg.autotp_size > 1 else "")
        + (f", sequence parallel {cfg.sequence_parallel_size}" if cfg.sequence_parallel_size > 1 else "")
        + "\n"
        f"# precision ({prec}) comes from the DeepSpeed JSON: accelerate refuses mixed_precision here\n"
        + (
            "# on every node: set main_process_ip to the first node's address and machine_rank to the node's index\n"
            if cluster.num_nodes > 1
            else ""
        )
        + (
            "# deepcompile: this file cannot turn it on (accelerate launch exports no dynamo setting for "
            "DeepSpeed); the script must: TrainingArguments(torch_compile=True), "
            'Accelerator(dynamo_backend="inductor") or engine.compile()\n'
            if cfg.deepcompile
            else ""
        )
        + f"# deepspeed_config_file ({rel}) is relative to this file's folder, and accelerate opens it from the folder\n"
        "# it is launched in: run `accelerate launch --config_file THIS_FILE train.py` in this file's folder\n"
    )
    return head + yaml.safe_dump(conf, sort_keys=False)


def parallelism_config_yaml(cfg: TrainConfig, cluster: Cluster) -> dict:
    """The `parallelism_config` section of an accelerate config file for Ulysses, with the keys accelerate 1.16
    reads (commands/launch.py copies them onto its --parallelism_config_* arguments; the path to the ranks'
    environment: docs/measurements/report.md, "Export: Ulysses through accelerate launch")."""
    sp = cfg.sequence_parallel_size
    p = "parallelism_config_"
    return {
        p + "sp_backend": "deepspeed",
        p + "sp_size": sp,
        p + "dp_shard_size": cluster.world_size // (cfg.autotp_size * sp),
        p + "sp_seq_length_is_variable": True,
        p + "sp_attn_implementation": cfg.attention,
    }


def parallelism_config_code(cfg: TrainConfig, cluster: Cluster) -> list[str]:
    """Python lines that build Accelerate's ParallelismConfig for Ulysses as the trials ran it (accelerate >= 1.12;
    accelerate/parallelism_config.py ParallelismConfig, accelerate/utils/dataclasses.py
    DeepSpeedSequenceParallelConfig, both exported by accelerate.utils): sp_backend "deepspeed", sp_size,
    dp_shard_size = world / sp and the handler's variable-length flag (the trials register Ulysses with
    seq_length_is_variable=True, so no sp_seq_length: the handler reads one only when the length is fixed) and
    attention implementation."""
    y = parallelism_config_yaml(cfg, cluster)
    p = "parallelism_config_"
    return [
        "from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig",
        f'parallelism_config = ParallelismConfig(sp_backend="deepspeed", sp_size={y[p + "sp_size"]}, '
        f"dp_shard_size={y[p + 'dp_shard_size']}, sp_handler=DeepSpeedSequenceParallelConfig("
        "sp_seq_length_is_variable=True, "
        f'sp_attn_implementation="{y[p + "sp_attn_implementation"]}"))',
    ]


def _sp_lines(cfg: TrainConfig, cluster: Cluster, accelerate_config: Path | None) -> list[str]:
    """What Ulysses asks of the training script, read from transformers 5.24, accelerate 1.16 and deepspeed 0.19.8."""
    sp = cfg.sequence_parallel_size
    if sp == 1:
        return []
    dp = cluster.world_size // (cfg.autotp_size * sp)
    lines = [
        f"Sequence parallelism (Ulysses {sp}, dp = {cluster.world_size} / {sp} = {dp}): the JSON's "
        f'"sequence_parallel_size": {sp} sets DeepSpeed\'s batch arithmetic; the Trainer takes Ulysses from '
        "Accelerate's ParallelismConfig (accelerate >= 1.12):",
        *("  " + line for line in parallelism_config_code(cfg, cluster)),
        "  TrainingArguments(..., as above, parallelism_config=parallelism_config)",
        "  accelerate then registers DeepSpeed's Ulysses attention (UlyssesSPAttentionHF.register_with_transformers) "
        "and cuts each batch along the sequence (UlyssesSPDataLoaderAdapter: accelerator.py _prepare_deepspeed, "
        "deepspeed_ulysses_dl_adapter);",
        "  the Trainer weights each rank's loss by its tokens (transformers integrations/deepspeed.py "
        "deepspeed_sp_compute_loss).",
        f"  Each batch must carry position_ids (UlyssesSPDataLoaderAdapter refuses one without them) and a length "
        f'that {sp} divides; load the model with attn_implementation="{cfg.attention}".',
        f"  dp_shard_size={dp}: accelerate rewrites train_batch_size as micro x grad accum x dp_replicate x dp_shard "
        "(accelerator.py _prepare_deepspeed), which DeepSpeed checks against world / sp.",
        f"  Global batch = per_device_train_batch_size x dp x gradient_accumulation_steps = "
        f"{cfg.micro_batch} x {dp} x {cfg.grad_accum} = {cfg.micro_batch * dp * cfg.grad_accum} sequences of "
        f"{cfg.seq_len} tokens (the {sp} ranks of a group share each sequence).",
    ]
    if accelerate_config is not None:
        lines.append(
            f"  {accelerate_config} carries the same settings (parallelism_config section): a script whose "
            "Accelerator or Trainer gets no parallelism_config takes them from accelerate launch."
        )
    lines.append(
        "  With deepspeed.initialize yourself (as the trials do): mpu = deepspeed.runtime.sequence_parallel.ulysses_sp."
        f"UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="
        f'"{cfg.attention}", sequence_parallel_size={sp}, micro_batch_size={cfg.micro_batch}, '
        "seq_length_is_variable=True) before deepspeed.initialize(..., mpu=mpu); wrap the data loader in "
        "UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=mpu.get_sequence_parallel_group(), "
        "sp_world_size=mpu.get_sequence_parallel_world_size(), device=...), and weight each rank's loss by its share "
        "of the group's labelled tokens."
    )
    return lines


def _compile_lines(cfg: TrainConfig, accelerate_config: Path | None) -> list[str]:
    """What DeepCompile asks of the training script: the JSON's "compile" section does nothing until
    engine.compile() is called (deepspeed 0.19.8 runtime/engine.py forward); who calls it in transformers 5.24 and
    accelerate 1.16: docs/measurements/report.md, "Export: who calls engine.compile()"."""
    if not cfg.deepcompile:
        return []
    lines = [
        'DeepCompile ("compile": {"deepcompile": true}): the JSON alone does not turn it on. DeepSpeed compiles only '
        'when engine.compile() is called; until then it logs "DeepCompile is enabled but engine.compile() has not been '
        'called; executing without DeepCompile" and trains uncompiled.',
        "  With deepspeed.initialize yourself (as the trials do): engine, optimizer, _, _ = deepspeed.initialize(...), "
        "then engine.compile() before the first forward (its default backend on CUDA is inductor).",
        "  Hugging Face Trainer: TrainingArguments(..., as above, torch_compile=True). The Trainer hands accelerate "
        'a TorchDynamoPlugin with torch_compile_backend (default "inductor"), and accelerate calls '
        'engine.compile(backend="inductor", ...) right after deepspeed.initialize (accelerator.py _prepare_deepspeed). '
        "Without torch_compile=True (and no ACCELERATE_DYNAMO_BACKEND in the environment) the Trainer does not call "
        "it, and trains without DeepCompile.",
        '  Keep torch_compile_backend "inductor" or "eager" (DeepCompile refuses any other) and regional compilation '
        "off (no ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true): with it accelerate compiles the blocks itself "
        "and never calls engine.compile().",
        '  accelerate without the Trainer: Accelerator(dynamo_backend="inductor") (or ACCELERATE_DYNAMO_BACKEND=inductor '
        "in the ranks' environment, which accelerate launch passes on); accelerator.prepare(...) then calls "
        "engine.compile() the same way.",
        "  accelerate launch does not call it: a dynamo_config section in an accelerate config file does not reach a "
        "DeepSpeed run (utils/launch.py prepare_deepspeed_cmd_env exports no ACCELERATE_DYNAMO_* variable), so "
        + ("the file written above has none; " if accelerate_config is not None else "")
        + "set it in the script as above.",
        "  CUDA only (torch >= 2.6), ZeRO 1-3; not measured here: autotune estimates and simulates the step as without it.",
    ]
    return lines


def _tp_lines(cfg: TrainConfig, cluster: Cluster) -> list[str]:
    """What AutoTP asks of the training script, checked against transformers 5.24, accelerate 1.16 and
    deepspeed 0.19.8 (tests/test_export_parallel.py trains the Trainer on it)."""
    tp = cfg.autotp_size
    if tp == 1:
        return []
    dp = cluster.world_size // tp
    return [
        f"Tensor parallelism (AutoTP {tp}, dp = {cluster.world_size} / {tp} = {dp}): the JSON's "
        f'"tensor_parallel": {{"autotp_size": {tp}}} is all the Trainer needs.',
        f"  The Trainer shards the model itself (transformers integrations/deepspeed.py deepspeed_init: "
        f"deepspeed.tp_model_init(model, tp_size={tp}, ...) before deepspeed.initialize), and accelerate gives",
        f"  the {tp} ranks of a tp group the same batches (data_loader.py prepare_data_loader: process index // {tp}).",
        f"  Global batch = per_device_train_batch_size x dp x gradient_accumulation_steps = "
        f"{cfg.micro_batch} x {dp} x {cfg.grad_accum} = {cfg.micro_batch * dp * cfg.grad_accum} sequences.",
        "  train_batch_size is left out of the JSON on purpose: DeepSpeed 0.19.8 checks it against the whole world "
        "(runtime/config.py _batch_assertion), not dp.",
        "  Every rank must start from the same weights (from_pretrained does; a random init needs one seed everywhere).",
        f"  With deepspeed.initialize yourself: the JSON alone shards the model (engine._apply_autotp_partitioning); "
        f"feed rank r the batches of data-parallel rank r // {tp}.",
    ]


def fixed_for_trainer(ds: dict) -> tuple[list[str], dict]:
    """The JSON's values the Trainer checks against its arguments (TRAINER_FILLED) that are numbers and not the
    tuned ones trainer_arguments gives: (the dotted keys with their values, the TrainingArguments repeating them)."""
    flat = leaves(ds)
    keys, args = [], {}
    for path in TRAINER_FILLED:
        v = flat.get(path, MISSING)
        names = TRAINER_FILLED[path]
        if v is MISSING or v == "auto" or _is_tuned(path) or names is None:
            continue
        keys.append(f"{path}={json.dumps(v)}")
        args.update(zip(names, v if len(names) == 2 and isinstance(v, list) else [v]))
    return keys, args


def trainer_line(cfg: TrainConfig, model: ModelSpec, path: Path, extra: dict | None = None) -> str:
    """The TrainingArguments line export prints, as Python: the JSON, the tuned arguments (trainer_arguments), and
    `extra`."""
    kwargs = {**trainer_arguments(cfg, model), **(extra or {})}
    return (
        f"TrainingArguments(deepspeed={json.dumps(str(path))}, "
        + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        + ")"
    )


def usage(
    cfg: TrainConfig,
    model: ModelSpec,
    cluster: Cluster,
    path: Path,
    accelerate_config: Path | None = None,
    *,
    style: str = "trainer",
    ds: dict | None = None,
) -> str:
    """How to use the exported files, which file suits which loop first."""
    ds = ds if ds is not None else deepspeed_config(cfg, model, cluster, style=style)
    nodes = f" --num_nodes {cluster.num_nodes} --hostfile HOSTFILE" if cluster.num_nodes > 1 else ""
    fixed, fixed_args = fixed_for_trainer(ds)
    launcher = [
        f"  deepspeed --num_gpus {cluster.gpus_per_node}{nodes} train.py --deepspeed_config {path}",
        "  (train.py: engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, "
        + (
            "model_parameters=model.parameters()))"
            if cfg.method == "full"
            else "model_parameters=[p for p in model.parameters() if p.requires_grad]))"
        ),
    ]
    if style == "trainer":
        lines = [
            f'{path} is for the Hugging Face Trainer (and accelerate): "auto" where the Trainer fills the value from '
            "its TrainingArguments (batch sizes, learning rate, betas, eps, weight decay, gradient clipping"
            + ("" if "scheduler" in ds else "; no scheduler section, so the Trainer's own runs")
            + "); the tuned keys (ZeRO, precision, ...) are numbers.",
            "  " + trainer_line(cfg, model, path),
            "  plus your own learning_rate, weight_decay, warmup_steps, lr_scheduler_type, max_grad_norm, ...: none is "
            "set above. per_device_train_batch_size and gradient_accumulation_steps are the tuned values: the JSON's "
            '"auto" batch sizes are filled from them.',
        ]
        if fixed:
            lines.append(
                f"  Your config fixes {', '.join(fixed)}: the Trainer refuses TrainingArguments that differ "
                f"(transformers integrations/deepspeed.py fill_match), so pass "
                f"{', '.join(f'{k}={v!r}' for k, v in fixed_args.items()) or 'the same'}, "
                'or write "auto" there to take the Trainer\'s.'
            )
        lines.append(f"  (transformers >= 5 names it activation_checkpointing; seq len {cfg.seq_len})")
        if accelerate_config is not None:
            lines += _accelerate_lines(accelerate_config, path)
        lines += [
            'Without the Trainer (a plain deepspeed.initialize loop): DeepSpeed resolves no "auto"; export again with '
            "--concrete (the same options) for a file of numbers at this path, then:",
            *launcher,
        ]
    else:
        lines = [
            f"{path} is for a plain deepspeed.initialize loop (no Trainer): every value a number"
            + (f" ({', '.join(fixed)})" if fixed else "")
            + ".",
            "Use it with the DeepSpeed launcher:",
            *launcher,
            'With the Hugging Face Trainer, export without --concrete ("auto" values, and your own '
            "hyperparameters); this file fixes them, and the Trainer refuses TrainingArguments that differ "
            "(transformers integrations/deepspeed.py fill_match), so it would need",
            "  " + trainer_line(cfg, model, path, fixed_args),
            f"  (transformers >= 5 names it activation_checkpointing; seq len {cfg.seq_len})",
        ]
        if accelerate_config is not None:
            lines += _accelerate_lines(accelerate_config, path)
    lines += _tp_lines(cfg, cluster)
    lines += _sp_lines(cfg, cluster, accelerate_config)
    lines += _compile_lines(cfg, accelerate_config)
    lines += _ckpt_lines(cfg, model)
    lines += _lora_lines(cfg, path)
    if cfg.optimizer == "adamw8bit":
        lines.append(
            "Optimizer: 8-bit AdamW is not a DeepSpeed config type: pass bitsandbytes.optim.AdamW8bit("
            "model.parameters(), ...) as deepspeed.initialize(optimizer=...) / "
            "Trainer(optim='adamw_bnb_8bit')."
        )
    return "\n".join(lines)


def _accelerate_lines(accelerate_config: Path, path: Path) -> list[str]:
    """How to start the exported YAML: in its own folder, since accelerate opens the JSON it names from the folder
    it is launched in (json_path_for_yaml)."""
    folder = Path(accelerate_config).parent
    here = Path(folder).resolve() == Path.cwd().resolve()
    rel = json_path_for_yaml(path, accelerate_config)
    return [
        f"  started by accelerate: accelerate launch --config_file {accelerate_config} train.py"
        + ("" if here else f", in {folder}"),
        f"  ({accelerate_config} names the JSON as {rel}, relative to its own folder: move the two together; "
        "accelerate opens it from the folder it is launched in. The Trainer then needs no deepspeed=: "
        "TrainingArguments takes the JSON accelerate names)",
    ]


_HF_LAYERS = {"gpt2": "model.transformer.h", "gpt_neox": "model.gpt_neox.layers", "mpt": "model.transformer.blocks"}
"""Where each family's decoder layers sit in its *ForCausalLM (transformers' modeling files); the
rest of the architectures autotune's presets use keep them at model.model.layers."""


def _ckpt_lines(cfg: TrainConfig, model: ModelSpec) -> list[str]:
    k, layers = cfg.ckpt_layers, model.num_layers
    if k == 0:
        return ["Activation checkpointing: none (every layer keeps its activations)."]
    if k >= layers:
        return [f"Activation checkpointing: all {layers} layers (gradient_checkpointing=True above)."]
    head = (
        f"Activation checkpointing: the first {k} of {layers} layers only. The Trainer's flag covers all "
        "layers, so keep it False and before training:"
    )
    if model.implementation == "hf":
        where = _HF_LAYERS.get(model.model_type, "model.model.layers")
        return [
            head,
            "  from autotune.impl.hf import checkpoint_first_layers",
            f"  checkpoint_first_layers(model, {k})",
            "  (what the trials ran; the same as transformers' own mechanism by hand:",
            '  model.activation_checkpointing_enable({"use_reentrant": False})',
            f"  for layer in {where}[{k}:]:",
            "      layer.gradient_checkpointing = False",
            "  GradientCheckpointingLayer checkpoints a layer only while its flag is set)",
        ]
    if model.implementation == "factory":
        return [
            f"Activation checkpointing: the first {k} of {layers} layers, as the trials ran it: each of the "
            f"first {k} decoder layers' forward under torch.utils.checkpoint.checkpoint(..., use_reentrant=False)",
            f"  (autotune.impl.impl_for(spec).checkpoint_first(model, {k}) does it for your module)",
        ]
    return [
        head,
        '  model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})',
        f"  for layer in model.model.layers[{k}:]:",
        "      layer.gradient_checkpointing = False",
        "  (transformers' GradientCheckpointingLayer checkpoints a layer only while its flag is set; plain PyTorch: "
        f"wrap the first {k} blocks in torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))",
    ]
