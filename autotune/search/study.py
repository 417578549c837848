"""Where a search lives: one Optuna study per search, by default one SQLite database per study
under `trials/<study>/study.db`; any Optuna storage URL is accepted (optuna-dashboard opens it).

Also the one mapping between a trial's typed record and Optuna: params are the searched TrainConfig
fields that vary; user attrs hold the whole config, the memory estimate and, for runs, the
TrialResult. The search writes through `running_attrs`, `result_attrs` and `pruned_record`; the
search, report and export read through `record_of` / `records` (a `TrialRecord`). Every bad input
is a SpecError (exit 2) and nothing existing is ever overwritten: an existing study is only
opened, never re-created.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
import sqlalchemy
import sqlalchemy.event
import sqlalchemy.exc
from optuna.distributions import CategoricalDistribution
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import SpecError
from autotune.hardware import Cluster, parse_gpus
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, searched_fields
from autotune.trial.record import ScriptSpec, Status, TrialResult

ATTR = "autotune"
"""Study user attr holding what a resumed search, the report and the export need."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

optuna.logging.set_verbosity(optuna.logging.WARNING)


def trials_root() -> Path:
    """Where study folders go: $AUTOTUNE_TRIALS_DIR, else ./trials."""
    return Path(os.environ.get("AUTOTUNE_TRIALS_DIR", "trials"))


def study_dir(name: str) -> Path:
    return trials_root() / name


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise SpecError(
            f"study name {name!r} must start with a letter or a digit, then letters, digits, '.', '_' or '-' "
            f"(it names a folder under {trials_root()}/)"
        )
    return name


def default_name(model: ModelSpec, cluster: Cluster, script: ScriptSpec | None = None) -> str:
    """`llama-2-13b_4xA100`; a config.json model is named after its folder (or file stem); code
    other than Hugging Face's adds its name (`tiny-llama_builtin_2xcpu`), so studies of two codes
    never resume each other; a script trial's study adds the script's stem (`llama-2-13b_4xA100_train`)."""
    p = Path(model.name)
    base = (p.parent.name or p.stem) if p.suffix == ".json" else model.name
    if model.implementation != "hf":
        base += f"_{model.implementation}"
    tail = f"_{Path(script.path).stem}" if script is not None else ""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{base}_{cluster.text or cluster.world_size}{tail}").strip("-")


def _meta_path(name: str) -> Path:
    return study_dir(name) / "study.json"


def storage_url(name: str, url: str | None = None) -> str:
    """The storage of study `name`: `url` if given, else the one recorded at creation, else the default."""
    if url:
        return url
    meta = _meta_path(name)
    if meta.exists():
        return json.loads(meta.read_text())["storage"]
    return f"sqlite:///{(study_dir(name) / 'study.db').resolve()}"


def _sqlite_file(url: str) -> Path | None:
    if url.startswith("sqlite:///"):
        return Path(url[len("sqlite:///") :].split("?")[0])
    return None


def _check_sqlite(path: Path) -> None:
    """Refuse a file that is not an Optuna SQLite database, reading it only (Optuna would add its tables)."""
    if path.is_dir():
        raise SpecError(f"{path} is a directory, not a study database file; pass a file path in --storage")
    with open(path, "rb") as f:
        header = f.read(16)
    if header and header != b"SQLite format 3\x00":
        raise SpecError(
            f"{path} is not a SQLite database (corrupt, or another file); it was left untouched. "
            f"Move it away or pass another --study/--storage"
        )
    if not header:
        return
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
    except sqlite3.DatabaseError as e:
        raise SpecError(f"{path} cannot be read as a SQLite database ({e}); it was left untouched") from None
    if tables and "studies" not in tables:
        raise SpecError(
            f"{path} is a SQLite database but not an Optuna study (tables: "
            f"{', '.join(sorted(tables))}); it was left untouched"
        )


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(f"cannot create the study database's folder {folder}: {e.strerror or e}") from None


def open_storage(url: str, *, must_exist: bool) -> RDBStorage:
    path = _sqlite_file(url)
    if path is not None:
        if path.exists():
            _check_sqlite(path)
        elif must_exist:
            raise SpecError(f"no study database at {path}{_known_hint()}")
        else:
            _make_folder(path.parent)
    try:
        # timeout: SQLite waits for a lock instead of failing when report and search overlap.
        storage = RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 30}} if path is not None else {})
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError, ValueError) as e:
        raise SpecError(f"cannot open study storage {_redacted(url)}: {e}") from None
    except ImportError as e:  # Optuna's RDBStorage: SQLAlchemy could not import the URL's database driver
        driver = getattr(e.__cause__, "name", None) or str(e.__cause__ or e)
        raise SpecError(
            f"cannot open study storage {_redacted(url)}: its database driver is not installed ({driver}); "
            f"install the driver SQLAlchemy names for this URL's dialect into autotune's environment, or use "
            f"the default SQLite storage (no --storage)"
        ) from None
    if path is not None:
        sqlalchemy.event.listen(storage.engine, "connect", _sqlite_pragmas)
        storage.engine.dispose()  # connections opened during setup are replaced by ones with the pragmas
    return storage


def _redacted(url: str) -> str:
    """A storage URL without its password (an error message is printed and may be logged)."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    """WAL with synchronous=NORMAL: a commit no longer waits for fsync (12 ms each on the test machines,
    measured), and a committed trial still survives the process being killed; only an OS crash or
    power loss can lose the last commits (sqlite.org/wal.html, sqlite.org/pragma.html#pragma_synchronous)."""
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _known_hint() -> str:
    names = list_studies()
    return f"; studies under {trials_root()}/: {', '.join(names)}" if names else f"; {trials_root()}/ holds no study"


def list_studies() -> list[str]:
    """Study folders under trials/, most recently changed first."""
    root = trials_root()
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if (d / "study.json").exists() or (d / "study.db").exists()]
    return [d.name for d in sorted(dirs, key=_mtime, reverse=True)]


def _mtime(d: Path) -> float:
    """When the study was last searched: its newest trial's start or end, read from its SQLite database
    read-only. Not the file's mtime: a reader's connection may checkpoint SQLite's WAL into the file
    (sqlite.org/wal.html, "Checkpointing"), so `autotune report` of an older study made it the newest at times.
    A study without trials, or not in a SQLite file here, counts from its folder's files."""
    db = d / "study.db"
    if db.exists():
        con = None
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            (newest,) = con.execute("select max(coalesce(datetime_complete, datetime_start)) from trials").fetchone()
            if newest:
                return datetime.datetime.fromisoformat(str(newest)).timestamp()
        except (sqlite3.Error, ValueError):
            pass
        finally:
            if con is not None:
                con.close()
    files = [d / n for n in ("study.db", "study.json")]
    return max((f.stat().st_mtime for f in files if f.exists()), default=d.stat().st_mtime)


def existing_study(name: str, url: str | None) -> optuna.Study | None:
    """Study `name` where it exists (as load_study opens it), else None, creating nothing but the folder of a new
    SQLite database: a folder that cannot be made, or a bad storage, fails now, before an executor starts."""
    check_name(name)
    url = storage_url(name, url)
    path = _sqlite_file(url)
    if path is not None and not path.exists():
        _make_folder(path.parent)
        return None
    if name in {s.study_name for s in open_storage(url, must_exist=False).get_all_studies()}:
        return load_study(name, url)
    return None


def assert_new(name: str, url: str | None) -> None:
    """Refuse a study name already taken, creating nothing (called before anything starts for it)."""
    if existing_study(name, url) is not None:
        raise SpecError(
            f"study {name!r} already exists in {_redacted(storage_url(name, url))}; continue it with --resume, or "
            f"choose another --study name (nothing was changed)"
        )


def create_study(name: str, url: str | None, attrs: dict, sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    """A new study; an existing one of that name is an error that suggests --resume."""
    assert_new(name, url)
    url = storage_url(name, url)
    storage = open_storage(url, must_exist=False)
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize", sampler=sampler)
    study.set_user_attr(ATTR, attrs)
    study_dir(name).mkdir(parents=True, exist_ok=True)
    if not _meta_path(name).exists():
        _meta_path(name).write_text(json.dumps({"study": name, "storage": url}, indent=1) + "\n")
    return study


def load_study(
    name: str | None, url: str | None = None, sampler: optuna.samplers.BaseSampler | None = None
) -> optuna.Study:
    """An existing study; `name` None means the most recent one under trials/."""
    if name is None:
        names = list_studies()
        if not names:
            raise SpecError(f"no study under {trials_root()}/; run `autotune search` first or pass --study")
        name = names[0]
    check_name(name)
    url = storage_url(name, url)
    storage = open_storage(url, must_exist=True)
    try:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    except KeyError:
        known = [s.study_name for s in storage.get_all_studies()]
        raise SpecError(
            f"no study named {name!r} in {url} (it holds: {', '.join(known) or 'none'}){_known_hint()}"
        ) from None
    if ATTR not in study.user_attrs:
        raise SpecError(f"study {name!r} in {url} was not made by `autotune search` (no {ATTR!r} attribute)")
    return study


class ChosenSampler(optuna.samplers.BaseSampler):
    """The study's sampler: every param is taken from `chosen`, where something asks (the search
    itself writes its trials whole, `start_trial`; autotune/search/loop.py says why no stock sampler)."""

    def __init__(self) -> None:
        self.chosen: dict[str, Any] = {}

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.chosen[param_name]


# ---- what a study records ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """How a study is searched, beyond its inputs: kept in the study (its ATTR's "settings") so that a resume, or
    the same command run again, searches on as it was started; a value given again explicitly replaces it."""

    exhaustive: bool = False
    """Run every feasible group (no stopping rule)."""
    tolerance: float = 0.02
    """The stopping rule's tolerance, a fraction (autotune/search/stopping.py)."""
    n_trials: int | None = None
    """Runs over the whole study, across resumes (None: no limit)."""
    concurrent_trials: int = 1
    """Trials that may run at once on the same devices."""

    def describe(self) -> str:
        """`the stopping rule at --tolerance 2%, no --n-trials, 1 trial at a time`."""
        how = (
            "--exhaustive (every feasible group runs)"
            if self.exhaustive
            else f"the stopping rule at --tolerance {100 * self.tolerance:.4g}%"
        )
        budget = "no --n-trials" if self.n_trials is None else f"--n-trials {self.n_trials} over the study"
        at_once = "1 trial at a time" if self.concurrent_trials == 1 else f"{self.concurrent_trials} trials at once"
        return f"{how}, {budget}, {at_once}"


def settings_of(study: optuna.Study) -> Settings | None:
    """The settings a study was last searched with; None for a study from before studies kept them."""
    kept = study.user_attrs[ATTR].get("settings")
    return None if kept is None else Settings(**kept)


def store_settings(study: optuna.Study, settings: Settings) -> None:
    study.set_user_attr(ATTR, {**study.user_attrs[ATTR], "settings": dataclasses.asdict(settings)})


def study_attrs(
    model: ModelSpec,
    cluster: Cluster,
    *,
    seq_len: int,
    global_batch: int | None,
    space_text: str,
    space_path: str,
    source: str,
    objective: str = "samples",
    settings: Settings | None = None,
    script: ScriptSpec | None = None,
) -> dict:
    return {
        **({"settings": dataclasses.asdict(settings)} if settings is not None else {}),
        **({"script": script.to_attrs()} if script is not None else {}),
        "model": dataclasses.asdict(model),
        "gpus": cluster.text,
        "capacity_bytes": cluster.capacity_bytes,
        "world_size": cluster.world_size,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "space_text": space_text,
        "space_path": space_path,
        "source": source,
        "objective": objective,
    }


def script_of(study: optuna.Study) -> ScriptSpec | None:
    """The user's script a study's trials run (`autotune search --script`); None: autotune's own loop."""
    kept = study.user_attrs[ATTR].get("script")
    return None if kept is None else ScriptSpec.from_attrs(kept)


def specs_of(study: optuna.Study) -> tuple[ModelSpec, Cluster, dict]:
    """The model and cluster a study was searched for (capacity as it was then)."""
    a = study.user_attrs[ATTR]
    model = ModelSpec(**a["model"])
    cluster = parse_gpus(a["gpus"])
    gpu = dataclasses.replace(cluster.gpu, memory_bytes=a["capacity_bytes"])
    return model, dataclasses.replace(cluster, gpu=gpu), a


def distributions(cands: list[TrainConfig]) -> dict[str, CategoricalDistribution]:
    """One categorical distribution per field that varies among the candidates (the whole config is a
    user attr; fixed fields as params would only add a database row per trial each)."""
    values = {f.name: sorted({getattr(c, f.name) for c in cands}, key=repr) for f in searched_fields()}
    return {p: CategoricalDistribution(v) for p, v in values.items() if len(v) > 1}


def params_of(cfg: TrainConfig, dists: dict) -> dict[str, Any]:
    return {p: getattr(cfg, p) for p in dists}


def pruned_record(cfg: TrainConfig, dists: dict, attrs: dict) -> FrozenTrial:
    """A PRUNED trial for a candidate decided without running (memory, dominated, oom-implied): what
    `optuna.trial.create_trial` makes, built directly, as a large space writes tens of thousands; its checks
    (old distribution classes, each param inside its distribution) hold by construction, as `distributions`
    made `dists` from the same candidates."""
    now = datetime.datetime.now()
    _WRITING[cfg.key()] = cfg
    return FrozenTrial(
        number=-1,
        trial_id=-1,
        state=TrialState.PRUNED,
        value=None,
        datetime_start=now,
        datetime_complete=now,
        params=params_of(cfg, dists),
        distributions=dists,
        user_attrs={"config": cfg.to_dict(), "status": "pruned", **attrs},
        system_attrs={},
        intermediate_values={},
    )


def add_finished(study: optuna.Study, trials: list[FrozenTrial]) -> None:
    """Append finished trials (the search's pruned candidates) in one transaction of three bulk inserts.

    `Study.add_trials` writes one trial at a time: a transaction that locks the study, counts its
    trials for the number, and checks every param's distribution and attr with queries of their own.
    Measured on SQLite (one trial with 4 params and 8 attrs): 7-9 ms per trial, so the 49k
    candidates that `search_spaces/full.yaml` prunes took over 10 minutes. This writes the same rows
    (Optuna's RDB schema: trials, trial_params, trial_user_attributes; a test reads them back against
    `add_trials`) under the same study lock, numbered after the study's last trial. Only trials whose
    params' distributions are the study's own (the search's) and without values, system attrs or
    intermediate values; anything else goes through `add_trials`.
    """
    from optuna.distributions import distribution_to_json
    from optuna.storages._rdb import models

    storage = getattr(study._storage, "_backend", study._storage)
    simple = all(
        t.state.is_finished() and t.values is None and not t.system_attrs and not t.intermediate_values for t in trials
    )
    if not trials or not isinstance(storage, RDBStorage) or not simple:
        study.add_trials(trials)
        return
    sid = study._study_id
    session = storage.scoped_session()
    try:
        models.StudyModel.find_or_raise_by_id(sid, session, for_update=True)
        base = session.query(models.TrialModel).filter(models.TrialModel.study_id == sid).count()
        # Core inserts (executemany), not ORM objects: the ORM's unit of work and bulk path cost more
        # than the rows themselves at 49k trials (a third of this function's time, py-spy)
        session.execute(
            models.TrialModel.__table__.insert(),
            [
                {
                    "study_id": sid,
                    "number": base + i,
                    "state": t.state,
                    "datetime_start": t.datetime_start,
                    "datetime_complete": t.datetime_complete,
                }
                for i, t in enumerate(trials)
            ],
        )
        ids = dict(
            session.query(models.TrialModel.number, models.TrialModel.trial_id).filter(
                models.TrialModel.study_id == sid, models.TrialModel.number >= base
            )
        )
        dist_json: dict[str, str] = {}
        params, attrs = [], []
        for i, t in enumerate(trials):
            tid = ids[base + i]
            for name, value in t.params.items():
                d = t.distributions[name]
                if name not in dist_json:
                    dist_json[name] = distribution_to_json(d)
                params.append(
                    {
                        "trial_id": tid,
                        "param_name": name,
                        "param_value": d.to_internal_repr(value),
                        "distribution_json": dist_json[name],
                    }
                )
            for k, v in t.user_attrs.items():
                text = json.dumps(v)
                attrs.append({"trial_id": tid, "key": k, "value_json": text})
                if k == "config" and isinstance(v, dict) and (cfg := _WRITING.pop(tuple(sorted(v.items())), None)):
                    _CONFIGS.setdefault(text, cfg)  # what reading this text back makes (_config_text)
        _insert_many(session, models.TrialParamModel.__table__, params)
        _insert_many(session, models.TrialUserAttributeModel.__table__, attrs)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _insert_many(session, table: sqlalchemy.Table, rows: list[dict[str, Any]]) -> None:
    """INSERT `rows` into `table` with the driver's own executemany. The rows of trial_params and
    trial_user_attributes are plain numbers and strings that need no type processing, and SQLAlchemy's
    executemany processes every row's parameters in Python (half of the insert's time at 49k trials)."""
    if not rows:
        return
    conn = session.connection()
    mark = {"qmark": "?", "format": "%s", "pyformat": "%s"}.get(conn.dialect.paramstyle)
    if mark is None:  # a driver with named or numbered parameters: through SQLAlchemy
        session.execute(table.insert(), rows)
        return
    quote = conn.dialect.identifier_preparer.quote
    cols = list(rows[0])
    conn.exec_driver_sql(
        f"INSERT INTO {quote(table.name)} ({', '.join(map(quote, cols))}) VALUES ({', '.join([mark] * len(cols))})",
        [tuple(r[c] for c in cols) for r in rows],
    )


def owner() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"


def owner_alive(tag: str) -> bool:
    """Whether the process that started a RUNNING trial still runs (only knowable on this host)."""
    host, _, pid = tag.rpartition(":")
    if host != os.uname().nodename or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_attrs(cfg: TrainConfig, estimate: dict) -> dict[str, Any]:
    """User attrs of a trial that starts: its config, its owner (to tell a crashed search from a
    live one) and the memory estimate; status 'running' until result_attrs replaces it."""
    return {"config": cfg.to_dict(), "status": "running", "owner": owner(), **estimate}


def start_trial(study: optuna.Study, cfg: TrainConfig, dists: dict, attrs: dict) -> optuna.Trial:
    """A RUNNING trial of `cfg` with its params and user attrs (running_attrs), written in one
    transaction: a process killed at any moment leaves it whole or absent. `Study.ask` would write
    them in one transaction each, and first reads every unfinished trial of the study to look for
    waiting ones: 1.3 s of each trial of lora.yaml's simulated 13B search (196 trials, cProfile on
    2 busy cores). The trial is then an ordinary one: set_user_attr, tell."""
    frozen = optuna.trial.create_trial(
        state=TrialState.RUNNING, params=params_of(cfg, dists), distributions=dists, user_attrs=attrs
    )
    return optuna.Trial(study, study._storage.create_new_trial(study._study_id, template_trial=frozen))


def mark_interrupted(study: optuna.Study, number: int, reason: str) -> None:
    """A RUNNING trial whose search is gone: FAIL, status `interrupted` and why. The attrs go first:
    a process killed before the state is written leaves it RUNNING, and the next resume marks it again."""
    storage = study._storage
    tid = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    storage.set_trial_user_attr(tid, "status", "interrupted")
    storage.set_trial_user_attr(tid, "reason", reason)
    storage.set_trial_state_values(tid, TrialState.FAIL)


def result_attrs(result: TrialResult) -> dict[str, Any]:
    """User attrs of a finished run: status, reason, source, and the whole TrialResult."""
    d = result.to_dict()
    d["log_tail"] = (d.get("log_tail") or "")[-4000:]
    return {"status": result.status, "reason": result.reason, "source": result.source, "result": d}


@dataclass(frozen=True)
class TrialRecord:
    """One study trial as autotune reads it back."""

    number: int
    state: TrialState
    status: Status | Literal["running", "interrupted"]
    """A run's or prune's status; `running` while its search runs it, `interrupted` when the search
    that ran it ended first (it runs again on --resume)."""
    config: TrainConfig | None
    result: TrialResult | None
    """The run's TrialResult (None for pruned and unfinished trials)."""
    estimate: dict[str, Any]
    """The memory estimate as recorded (total_bytes, tensor_bytes, capacity_bytes, dominant_term, phase)."""
    value: float | None = None
    pruned_by: str | None = None
    reason: str = ""
    source: str | None = None
    owner: str = ""


def _record(number: int, state: TrialState, a: dict[str, Any], value: float | None) -> TrialRecord:
    c = a.get("config")
    status = a.get("status", "running")
    if status == "running" and state != TrialState.RUNNING:
        status = "interrupted"
    res = a.get("result")
    cfg = c if isinstance(c, TrainConfig) else _config(c) if c else None
    return TrialRecord(
        number=number,
        state=state,
        status=status,
        config=cfg,
        result=TrialResult.from_dict(res) if res else None,
        estimate=a.get("estimate") or {},
        value=value,
        pruned_by=a.get("pruned_by"),
        reason=a.get("reason", ""),
        source=a.get("source"),
        owner=a.get("owner", ""),
    )


def records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial of `study` as a TrialRecord, by number.

    On an RDB storage the rows are read in three queries (`_read_rows`), not through
    `Study.get_trials`, which builds each FrozenTrial from ORM objects with its params and their
    distributions: the 49k trials `search_spaces/full.yaml` records took it 15-50 s per read here,
    and a search reads them three times for its report. The result is the same (a test reads both)."""
    storage = getattr(study._storage, "_backend", study._storage)
    if isinstance(storage, RDBStorage):
        return _read_rows(storage, study._study_id)
    return [record_of(t) for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)]


def _read_rows(storage: RDBStorage, sid: int) -> list[TrialRecord]:
    """`record_of` for every trial of study `sid`, from Optuna's RDB schema (trials, trial_user_attributes,
    trial_values at objective 0: what FrozenTrial.user_attrs and .value hold). Every write is made
    through the storage at once (Optuna's _CachedStorage writes through), so the rows are current."""
    from optuna.storages._rdb import models

    session = storage.scoped_session()
    try:
        trials = (
            session.query(models.TrialModel.trial_id, models.TrialModel.number, models.TrialModel.state)
            .filter(models.TrialModel.study_id == sid)
            .all()
        )
        attrs: dict[int, dict[str, Any]] = {}
        for tid, key, value in (
            session.query(
                models.TrialUserAttributeModel.trial_id,
                models.TrialUserAttributeModel.key,
                models.TrialUserAttributeModel.value_json,
            )
            .join(models.TrialModel)
            .filter(models.TrialModel.study_id == sid)
        ):
            # a config as its TrainConfig straight from the stored text: many trials share few configs' texts
            attrs.setdefault(tid, {})[key] = _config_text(value) if key == "config" else json.loads(value)
        values = {
            tid: models.TrialValueModel.stored_repr_to_value(v, kind)
            for tid, v, kind in session.query(
                models.TrialValueModel.trial_id, models.TrialValueModel.value, models.TrialValueModel.value_type
            )
            .join(models.TrialModel)
            .filter(models.TrialModel.study_id == sid, models.TrialValueModel.objective == 0)
        }
    finally:
        session.close()
    return [
        _record(number, state, attrs.get(tid, {}), values.get(tid))
        for tid, number, state in sorted(trials, key=lambda r: r[1])
    ]


def record_of(t: FrozenTrial) -> TrialRecord:
    return _record(t.number, t.state, t.user_attrs, t.value)


_CONFIGS: dict[str, TrainConfig | None] = {}
"""A config's JSON -> its TrainConfig: a study's records are read several times per search."""
_WRITING: dict[tuple, TrainConfig] = {}
"""Configs of pruned records not yet written, by key: `add_finished` files each under the JSON it writes, so the
search's own report reads its 27,319 pruned candidates of full.yaml (13B on 4 x A100) back without parsing and
checking each config again."""


def _config(c: dict) -> TrainConfig:
    key = json.dumps(c, sort_keys=True)
    if key not in _CONFIGS:
        _CONFIGS[key] = TrainConfig(**c)
    return _CONFIGS[key]


def _config_text(text: str) -> TrainConfig | None:
    """A stored config attr (its JSON text) as a TrainConfig, through `_config`'s memo, by text first."""
    if text not in _CONFIGS:
        c = json.loads(text)
        _CONFIGS[text] = _config(c) if c else None
    return _CONFIGS[text]


def jsonable(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str) else json.loads(json.dumps(v, default=str))
