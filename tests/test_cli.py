"""`embcache train` and `embcache bench`, run in-process through `main`."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import embcache
from embcache.checkpoint import latest_snapshot
from embcache.cli import available_benchmarks, main
from embcache.data.synthetic import SyntheticConfig, SyntheticCriteo
from embcache.models.dlrm import DLRM
from embcache.train.loop import make_dense_optimizer, make_sparse_optimizer

TINY = [
    "train",
    "--scale", "0.0005",
    "--steps", "6",
    "--batch-size", "64",
    "--dim", "8",
    "--eval-batches", "2",
    "--no-progress",
]  # fmt: skip


@pytest.fixture(autouse=True)
def keep_threads():
    """`embcache train` sets torch's thread count (--threads); restore it for other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def test_train_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "embcache train: summary" in out
    for key in ("loss", "held-out", "AUC", "hit rate", "evictions", "tier traffic", "samples/s"):
        assert key in out, key
    assert "(first 10% of steps) ->" in out


@pytest.mark.parametrize(
    "extra",
    [
        ["--optimizer", "sgd", "--policy", "lfu", "--no-prefetch"],
        ["--optimizer", "adam", "--cache-capacity", "1", "--eval-batches", "0"],
    ],
    ids=["sgd-lfu-noprefetch", "adam-capacity1"],
)
def test_train_variants(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, *extra]) == 0
    assert "embcache train: summary" in capsys.readouterr().out


def test_plot_writes_png(tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    assert main([*TINY, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoint_then_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    assert main([*TINY, "--checkpoint", str(ckpt)]) == 0
    snapshot = latest_snapshot(ckpt)
    assert (snapshot / "manifest.json").exists()
    # It loads into a fresh DLRM with the same options, and training really changed it.
    data = SyntheticCriteo(SyntheticConfig(scale=0.0005, batch_size=64))
    fresh = DLRM(data.tables(8), bottom_mlp=(64, 8), top_mlp=(64, 32))
    sparse = make_sparse_optimizer("adagrad", fresh.sparse_arch, 0.05)
    dense = make_dense_optimizer("adagrad", fresh.dense_parameters(), 0.01)
    untrained = fresh.state_dict()
    embcache.load(ckpt, fresh, [sparse, dense])
    loaded = fresh.state_dict()
    assert loaded.keys() == untrained.keys()
    assert any(not torch.equal(loaded[k], untrained[k]) for k in loaded)
    # --resume continues from it: 6 + 6 steps equal 12 steps in one run.
    capsys.readouterr()
    assert main([*TINY, "--resume", str(ckpt), "--checkpoint", str(tmp_path / "b")]) == 0
    twelve = [a if a != "6" else "12" for a in TINY]
    assert main([*twelve, "--checkpoint", str(tmp_path / "c")]) == 0
    resumed, straight = (DLRM(data.tables(8), bottom_mlp=(64, 8), top_mlp=(64, 32)) for _ in "bc")
    for model, name in ((resumed, "b"), (straight, "c")):
        opts = [
            make_sparse_optimizer("adagrad", model.sparse_arch, 0.05),
            make_dense_optimizer("adagrad", model.dense_parameters(), 0.01),
        ]
        embcache.load(tmp_path / name, model, opts)
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_resume_from_nothing_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*TINY, "--resume", str(tmp_path)])
    assert info.value.code == 2
    assert "no complete checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--optimizer", "lamb"], "invalid choice: 'lamb'"),
        (["train", "--cache-capacity", "0"], "--cache-capacity must be >= 1"),
        (["train", "--load-factor", "1.5"], "--load-factor must be in (0, 1]"),
        (["train", "--cache-capacity", "5", "--load-factor", "0.5"], "not allowed with"),
        (["train", "--scale", "0"], "--scale must be in (0, 1]"),
        (["train", "--steps", "0"], "--steps must be >= 1"),
        (["train", "--store", "memcached://x"], "--store: unknown store"),
        (
            ["train", "--store", "redis://127.0.0.1:1/0", "--tier-capacity", "9"],
            "bound the tables in front of it with --store tiered+redis://",
        ),
        (["bench", "nosuch"], "unknown benchmark(s) ['nosuch']"),
        ([], "the following arguments are required"),
    ],
    ids=[
        "optimizer",
        "capacity0",
        "load_factor",
        "both_sizes",
        "scale",
        "steps",
        "store_form",
        "redis_tier_capacity",
        "bench_name",
        "no_command",
    ],
)
def test_bad_options_exit_2(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    assert _exit_code([*TINY, "--store", url]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert url in lines[0] and lines[0].startswith("embcache train: error:")
    assert "Traceback" not in err


def test_help_mentions_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--scale", "--dim", "--cache-capacity", "--load-factor", "--policy", "--optimizer",
        "--lr", "--dense-lr", "--store", "--steps", "--batch-size", "--zipf", "--seed",
        "--checkpoint", "--device", "--plot", "--prefetch", "--eval-batches", "--threads",
        "--data", "--buckets", "--eval-fraction", "--eval-every", "--fusion-k", "--epochs",
        "--early-stop",
    ):  # fmt: skip
        assert flag in out, flag


def test_bench_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.strip().splitlines() if not line[0].isspace()]
    assert names == sorted(available_benchmarks())
    assert {"cache_index", "e2e"} <= set(names)


def test_train_on_redis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.kv.redis_servers import running_server

    with running_server(tmp_path) as server:
        url = f"{server.url}?namespace=cli_test"
        assert main([*TINY, "--store", url]) == 0
        out = capsys.readouterr().out
        assert f"store {url}" in out
        assert "tier traffic" in out
        assert len(server.client().keys("cli_test:meta:*")) == 26


def test_train_on_two_ranks() -> None:
    """--nproc 2: the tables sharded by row over two spawned ranks, the MLPs under DDP.

    Run as a command: the ranks print through the process that started them, which a test's
    output capture does not see when an earlier test started the fork server.
    """
    steps = [a if a != "6" else "30" for a in TINY]
    done = subprocess.run(
        [sys.executable, "-m", "embcache.cli", *steps, "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("embcache train: summary") == 1, "rank 0 alone prints the summary"
    assert "2 ranks" in out
    found = re.search(r"loss\s+([\d.]+) \(first 10% of steps\) -> ([\d.]+)", out)
    assert found, out
    assert float(found[2]) < float(found[1]), "training on two ranks must lower the loss"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--nproc", "3"], "multiple of the number of ranks"),
    ],
)
def test_bad_distributed_options(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*TINY, *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's latest snapshot under ``root``, by file and key, but the
    caches' states: which rows a cache holds depends on the evaluations a run made (a resumed
    run evaluated at its first checkpoint too), and with an unbounded tier it changes no number."""
    out = {}
    for rank_dir in sorted(root.glob("rank-*")):
        snap = latest_snapshot(rank_dir)
        for f in sorted((snap / "tables").glob("*.safetensors")) + sorted(
            snap.glob("*.safetensors")
        ):
            for key, value in load_file(f).items():
                out[f"{rank_dir.name}/{f.relative_to(snap)}:{key}"] = value
    return out


def test_two_ranks_checkpoint_and_resume(tmp_path: Path) -> None:
    """Each rank saves the rows it owns; 4 + 4 resumed steps equal 8 steps in one run."""

    def run(*extra: str) -> None:
        argv = [a for a in TINY if a not in ("6", "--steps")]
        done = subprocess.run(
            [sys.executable, "-m", "embcache.cli", *argv, "--nproc", "2", *extra],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr

    run("--steps", "4", "--checkpoint", str(tmp_path / "a"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["rank-0", "rank-1"]
    run("--steps", "4", "--resume", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "b"))
    run("--steps", "8", "--checkpoint", str(tmp_path / "c"))
    resumed, straight = _checkpoint_tensors(tmp_path / "b"), _checkpoint_tensors(tmp_path / "c")
    assert resumed.keys() == straight.keys() and resumed
    for key, value in straight.items():
        if key.endswith(":ids") or key.endswith(":rows"):
            continue  # compared as tables below
        assert torch.equal(resumed[key], value), key
    tables = {key.rsplit(":", 1)[0] for key in straight if key.endswith(":ids")}
    assert tables
    for name in sorted(tables):
        _assert_same_table(name, resumed, straight)


def _assert_same_table(
    name: str, first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]
) -> None:
    """The same table in two checkpoints: every row both hold is equal, and a row only one
    holds was never updated (its optimizer state, the columns past ``--dim 8``, is zero: a row
    read but never trained, which the other tier reads as the same initial row). Which
    untrained rows a tier holds depends on the reads a run made under ``torch.no_grad()``
    (evaluations create nothing), not on training."""
    rows = {}
    for label, tensors in (("first", first), ("second", second)):
        ids, values = tensors[f"{name}:ids"], tensors[f"{name}:rows"]
        rows[label] = {int(i): values[k] for k, i in enumerate(ids.tolist())}
    both = rows["first"].keys() & rows["second"].keys()
    assert both, name
    for i in both:
        assert torch.equal(rows["first"][i], rows["second"][i]), f"{name}: row {i}"
    for label, other in (("first", "second"), ("second", "first")):
        for i in rows[label].keys() - rows[other].keys():
            state = rows[label][i][8:]
            assert not state.any(), f"{name}: row {i}, trained, is missing from the {other} run"


# -- --data KIND:PATH: every real format, written here in small files ---------------------------


def _real_data(kind: str, root: Path) -> str:
    from tests.data import formats

    if kind == "criteo":
        return f"criteo:{formats.write_criteo(root / 'train.txt', 2500, seed=0)}"
    if kind == "criteo-gzip":
        return f"criteo:{formats.write_criteo(root / 'train.txt.gz', 2500, seed=0, gz=True)}"
    if kind == "criteo-days":
        return f"criteo:{formats.write_criteo_days(root / 'days', days=3, n=900, gz=True)}"
    if kind == "criteo-npy":
        return f"criteo-npy:{formats.write_criteo_npy(root / 'npy', days=3, n=900)}"
    if kind == "ml-100k":
        return f"movielens:{formats.write_ml_100k(root / 'ml-100k')}"
    return f"movielens:{formats.write_ml_1m(root / 'ml-1m')}"


REAL = ["--steps", "40", "--batch-size", "64", "--dim", "8", "--buckets", "500", "--no-progress"]


@pytest.mark.parametrize(
    "kind", ["criteo", "criteo-gzip", "criteo-days", "criteo-npy", "ml-100k", "ml-1m"]
)
def test_train_on_each_real_format(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`embcache train --data KIND:PATH` trains on the file and evaluates on its held-out
    split: AUC and log loss in the summary, above chance (the files' labels follow their
    features)."""
    spec = _real_data(kind, tmp_path)
    argv = ["train", "--data", spec, *REAL]
    if kind.startswith("ml"):
        argv = [a for a in argv if a not in ("--buckets", "500")]  # Criteo's option
    assert main(argv) == 0
    out = capsys.readouterr().out
    found = re.search(r"held-out\s+AUC ([\d.]+), logloss ([\d.]+) on ([\d,]+) samples", out)
    assert found, out
    assert float(found[1]) > 0.6, out
    assert 0 < float(found[2]) < 0.69, out  # better than a constant guess at p = 0.5
    expected = {"criteo-npy": "Criteo npy", "ml-100k": "MovieLens ml-100k", "ml-1m": "ml-1m"}
    assert expected.get(kind, "Criteo text") in out
    if kind == "criteo-days":
        assert "last day held out (day_2.gz)" in out and "on 900 samples" in out
    if kind.startswith("ml"):
        assert "0 dense and 6 sparse features" in out  # no zip: a second user id


def test_raw_criteo_ids_in_bounded_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--buckets 0: the raw hashed ids go straight into unbounded tables; with a tier capacity,
    admission and bf16 rows the run trains, evicts from the tier, refuses one-off ids, and says
    so; --buckets 0 without a cache capacity is refused up front."""
    from tests.data import formats

    path = formats.write_criteo(tmp_path / "raw.txt", 2500, seed=0, pool=3000)
    argv = ["train", "--data", f"criteo:{path}", *REAL[:-3], "--buckets", "0", "--no-progress"]
    memory = ["--cache-capacity", "512", "--tier-capacity", "128", "--admit-after", "2",
              "--weight-dtype", "bf16", "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
    assert main([*argv, *memory]) == 0
    out = capsys.readouterr().out
    assert "as raw hashed ids (unbounded tables)" in out
    assert "bf16 weights, tier 128 rows/table (LRU), admit after 2" in out
    found = re.search(r"admission\s+([\d,]+) lookups of ids not admitted", out)
    assert found and int(found[1].replace(",", "")) > 0, out
    assert re.search(r"tier\s+[\d,]+ rows evicted from the bounded tables", out), out
    assert float(re.search(r"held-out\s+AUC ([\d.]+)", out)[1]) > 0.55, out
    assert main([*argv, *memory, "--resume", str(tmp_path / "ck"), "--steps", "5"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(argv)
    assert "--buckets 0 makes unbounded tables" in capsys.readouterr().err


def _checkpoint_ids(root: Path) -> torch.Tensor:
    """The ids of every row a checkpoint holds, all tables together."""
    files = sorted((latest_snapshot(root) / "tables").glob("*.safetensors"))
    return torch.cat([load_file(f)["ids"] for f in files])


def test_fusion_k_keeps_raw_criteo_ids_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--buckets 0 --fusion-k 40: Criteo's 32-bit raw hashes, most of them at or above 2**30,
    are the rows' ids as they are; the default 30 bits fold those into 30 bits. A checkpoint
    records the width: resuming it with another is a usage error, with nothing loaded."""
    from tests.data import formats

    path = formats.write_criteo(tmp_path / "raw.txt", 600, seed=0, pool=3000)
    # The raw values of the 26 categorical columns (an empty one is id 0).
    raw = {int(v or "0", 16) for line in path.read_text().splitlines()
           for v in line.split("\t")[14:]}  # fmt: skip
    argv = ["train", "--data", f"criteo:{path}", *REAL[:-3], "--buckets", "0", "--steps", "5",
            "--cache-capacity", "512", "--eval-batches", "0", "--no-progress"]  # fmt: skip
    wide, narrow = tmp_path / "k40", tmp_path / "k30"
    assert main([*argv, "--fusion-k", "40", "--checkpoint", str(wide)]) == 0
    assert main([*argv, "--checkpoint", str(narrow)]) == 0
    capsys.readouterr()
    ids = _checkpoint_ids(wide)
    assert set(ids.tolist()) <= raw and int((ids >= 2**30).sum()) > ids.numel() // 2
    folded = _checkpoint_ids(narrow)
    assert bool((folded < 2**30).all()) and not set(folded.tolist()) <= raw
    assert _exit_code([*argv, "--resume", str(wide)]) == 2
    assert "written with --fusion-k 40, this run has 30" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fusion-k", "0"], "--fusion-k must be in [1, 56] (bits of an id), got 0"),
        (["--fusion-k", "57"], "--fusion-k must be in [1, 56] (bits of an id), got 57"),
        (["--fusion-k", "8"], "--fusion-k 8: a table of"),
    ],
)
def test_bad_fusion_k_exits_2(extra, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code([*TINY, *extra]) == 2
    assert message in capsys.readouterr().err


def test_eval_every_plots_auc_and_log_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _real_data("ml-1m", tmp_path)
    png = tmp_path / "run.png"
    argv = ["train", "--data", spec, *REAL[:-3], "--no-progress", "--eval-every", "10"]
    assert main([*argv, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"during run\s+3 evaluations \(every 10 steps\); best AUC 0\.\d+ at step", out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from embcache.cli.report import write_plot
    from embcache.train.loop import TrainResult

    # The third panel exists only with evaluations: the PNG is taller.
    plain = tmp_path / "plain.png"
    write_plot(TrainResult([0.5] * 4, [0.5] * 4, 1.0, 4, {}, None), plain)
    from matplotlib.image import imread

    assert imread(png).shape[0] > imread(plain).shape[0]


def test_train_on_real_data_with_two_ranks(tmp_path: Path) -> None:
    spec = _real_data("criteo", tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "embcache.cli", "train", "--data", spec, *REAL, "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("embcache train: summary") == 1
    assert "2 ranks" in done.stdout and "prefetch on" in done.stdout  # sharded prefetch
    found = re.search(r"held-out\s+AUC ([\d.]+)", done.stdout)
    assert found and float(found[1]) > 0.6, done.stdout


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("parquet:/x", "expected KIND:PATH with KIND one of criteo, criteo-npy, movielens"),
        ("criteo:/nonexistent/train.txt", "no such file or directory"),
        ("movielens:.", "neither u.data (ml-100k) nor ratings.dat (ml-1m)"),
    ],
    ids=["kind", "missing", "not-movielens"],
)
def test_bad_data_exits_2(data: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["train", "--data", data, *REAL]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the usage line
    assert last.startswith(f"embcache train: error: --data {data}: ") and message in last, last


def test_a_bad_line_mid_run_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.data.formats import criteo_lines

    bad = tmp_path / "bad.txt"
    lines = criteo_lines(600, seed=1)
    lines[300] = "1\tnot\tenough"
    bad.write_text("\n".join(lines) + "\n")
    assert _exit_code(["train", "--data", f"criteo:{bad}", *REAL]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"--data: {bad} line 301: expected a 0/1 label" in err


def test_synthetic_options_are_refused_with_data(tmp_path: Path, capsys) -> None:
    spec = _real_data("ml-100k", tmp_path)
    assert _exit_code(["train", "--data", spec, "--scale", "0.1"]) == 2
    assert "--scale describes the synthetic data" in capsys.readouterr().err


def test_torchrun_runs_the_same_job(tmp_path: Path) -> None:
    """Under torchrun (WORLD_SIZE set) each rank runs the one training job as its rank."""
    spec = _real_data("ml-100k", tmp_path)
    argv = ["train", "--data", spec, *[a for a in REAL if a not in ("--buckets", "500")]]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "embcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("embcache train: summary") == 1
    assert "2 ranks" in done.stdout and "MovieLens ml-100k" in done.stdout
    found = re.search(r"held-out\s+AUC ([\d.]+)", done.stdout)
    assert found and float(found[1]) > 0.6, done.stdout
