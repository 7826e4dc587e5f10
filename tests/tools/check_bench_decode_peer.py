#!/usr/bin/env python3
"""stepq bench decode --peer FILE (host backend, hand-written peer files) and the decode mode
of tools/scripts/bench_peer_fla.py:
  - the script's shapes are bench decode's: its presets are `stepq mkmap --shape`'s (arch,
    heads, head dims, recurrent layers), and a map file's shape is the map's;
  - a peer file of the run's shape adds a "fla fp32 (peer)" row per batch (tokens/s = B x T /
    its decode time, vs fp32 over the run's fp32 row) and "vs peer" to the run's rows, in the
    table and in --json; a batch the file lacks shows "-" (JSON: ran false); --tp 2 --procs
    compares one rank's heads;
  - a peer file of another shape (arch, heads, layers, tokens, dtype), another format, or a
    broken one is refused in one line naming --peer and the file, before any work (nothing on
    stdout, no rank started);
  - where a torch is installed (CPU is enough), the script's decode loop runs on a stand-in
    fla (naive kernels with fla's signatures, checking what they are given) and bench decode
    accepts the file it writes, for GDN and KDA.
Usage: check_bench_decode_peer.py STEPQ_EXE SOURCE_ROOT [PYTHON_WITH_TORCH]"""
import copy
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_checks import bench, check, failed  # noqa: E402
import tempfile

EXE, ROOT = sys.argv[1], sys.argv[2]
TORCH_PY = sys.argv[3] if len(sys.argv) > 3 else sys.executable
MAP = os.path.join(ROOT, "config", "examples", "qwen3.8-27b.stepq-6-layout.json")
SCRIPT = os.path.join(ROOT, "tools", "scripts", "bench_peer_fla.py")
os.environ["STEPQ_EXE"] = EXE  # the script resolves presets through this build's stepq mkmap
ENV = dict(os.environ, STEPQ_PROGRESS="off")
SMALL = ["--backend", "host", "--batch", "1,3", "--tokens", "3", "--layers", "1"]
LABEL = "fla fp32 (peer)"



def run(args, env=ENV):
    return bench(EXE, args, env)


def peer_doc(H=16, HV=48, layers=1, tokens=3, arch="gdn", dtype="bf16", batches=((1, 0.01),)):
    return {"format": "stepq-bench-decode-peer", "version": 1, "label": LABEL,
            "device": "NVIDIA H200", "kernel": "fused_recurrent_gated_delta_rule, its new state carried",
            "launch": "eager",
            "shape": {"name": "qwen3.8-27b", "arch": arch, "num_k_heads": H, "num_v_heads": HV,
                      "head_k_dim": 128, "head_v_dim": 128, "model_layers": 48, "layers": layers},
            "tokens": tokens, "warmup": 1, "runs": 3, "dtype": dtype,
            "batches": [{"batch": b, "decode_s": s, "tokens_per_s": b * tokens / s}
                        for b, s in batches]}


def write(d, name, doc):
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def shapes():
    for preset in ("qwen3.8-27b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "tiny-gdn"):
        m = subprocess.run([EXE, "mkmap", "--shape", preset, "--method", "fp32"],
                           capture_output=True, text=True, check=True)
        want = json.loads(m.stdout)["model"]
        p = subprocess.run([sys.executable, SCRIPT, "--decode", preset, "--print-shape"],
                           capture_output=True, text=True)
        try:
            got = json.loads(p.stdout)
            ok = (got["arch"] == want["arch"] and got["model"] == want["name"] and
                  all(got[k] == want[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim",
                                                  "head_v_dim")) and
                  got["layers"] == got["model_layers"] == len(want["recurrent_layers"]))
        except (ValueError, KeyError):
            ok = False
        check(ok, "bench_peer_fla.py --decode %s: stepq mkmap's shape" % preset,
              p.stdout + p.stderr)
    want = json.load(open(MAP))["model"]
    p = subprocess.run([sys.executable, SCRIPT, "--decode", MAP, "--layers", "2", "--print-shape"],
                       capture_output=True, text=True)
    got = json.loads(p.stdout) if p.returncode == 0 else {}
    check(got.get("num_v_heads") == want["num_v_heads"] and got.get("layers") == 2 and
          got.get("model_layers") == len(want["recurrent_layers"]),
          "bench_peer_fla.py --decode MAP --layers 2: the map's shape, 2 layers", p.stdout + p.stderr)
    # One line and status 2 for bad options, no torch needed.
    for args, want in ((["--decode", "qwen9"], "--decode 'qwen9'"),
                       (["--heads", "16,47,48,gdn", "--print-shape"], "--heads"),
                       (["--decode", "tiny-gdn", "--layers", "7", "--print-shape"], "--layers 7"),
                       (["--decode", "tiny-gdn", "--batch", "0"], "--batch"),
                       (["--tokens", "3", "--fla", "x"], "--tokens is decode mode's")):
        p = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True)
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 2 and len(lines) == 1 and want in lines[0],
              "bench_peer_fla.py %s: refused in one line" % " ".join(args), p.stderr)


def rows_of(d):
    return {b["batch"]: {r["label"]: r for r in b["rows"]} for b in d["batches"]}


def with_peer(d):
    path = write(d, "peer.json", peer_doc())
    p = run([MAP] + SMALL + ["--peer", path, "--json"])
    try:
        j = json.loads(p.stdout)
        rows = rows_of(j)
        pr, fp = rows[1][LABEL], rows[1]["fp32"]
        tps = 1 * 3 / 0.01
        ok = (p.returncode == 0 and j["peer"]["file"] == path and j["peer"]["batches"] == [1] and
              pr["ran"] and abs(pr["tokens_per_s"] - tps) < 1e-9 * tps and
              abs(pr["ms_per_step"] - 1e3 * 0.01 / 3) < 1e-12 and
              abs(pr["speedup_vs_fp32"] - tps / fp["tokens_per_s"]) < 1e-9 and
              all(abs(rows[1][k]["speedup_vs_peer"] - rows[1][k]["tokens_per_s"] / tps) < 1e-9
                  for k in ("fp32", "bf16", "stepq@6")) and
              not rows[3][LABEL]["ran"] and rows[3][LABEL]["not_run"] == "not in the peer file" and
              rows[3]["fp32"]["speedup_vs_peer"] == 0)
    except (ValueError, KeyError, TypeError) as e:
        print(e)
        ok = False
    check(ok, "bench decode --peer --json: the peer's row, vs fp32 and vs peer", p.stdout[-600:] + p.stderr)

    p = run([MAP] + SMALL + ["--peer", path])
    lines = p.stdout.splitlines()
    peer_rows = [l.split() for l in lines if LABEL in l and l.split()[0] in ("1", "3")]
    head = [l for l in lines if l.split()[:2] == ["batch", "state"]]
    ok = (p.returncode == 0 and len(peer_rows) == 2 and peer_rows[0][4] == "300.0" and
          peer_rows[1][4:] == ["-"] * 7 and head and "vs peer" in head[0] and
          "NOTE: the peer ran on another device" in p.stdout)
    check(ok, "bench decode --peer: a peer row per batch, '-' where the file lacks the batch",
          p.stdout + p.stderr)

    # --tp 2 --procs: the peer times one rank's heads.
    path2 = write(d, "peer-tp2.json", peer_doc(H=8, HV=24))
    p = run([MAP] + SMALL + ["--tp", "2", "--procs", "--peer", path2, "--json"])
    try:
        rows = rows_of(json.loads(p.stdout))
        ok = (p.returncode == 0 and rows[1][LABEL]["ran"] and not rows[3][LABEL]["ran"] and
              rows[1]["stepq@6"]["speedup_vs_peer"] > 0)
    except (ValueError, KeyError, TypeError):
        ok = False
    check(ok, "bench decode --tp 2 --procs --peer: the peer row for one rank's heads",
          p.stdout[-400:] + p.stderr)
    p = run([MAP] + SMALL + ["--tp", "2", "--procs", "--peer", path2])
    peer_rows = [l.split() for l in p.stdout.splitlines()
                 if LABEL in l and l.split()[0] in ("1", "3")]
    check(p.returncode == 0 and len(peer_rows) == 2 and peer_rows[0][4] == "300.0" and
          peer_rows[1][4:8] == ["-"] * 4,
          "bench decode --tp 2 --procs --peer: the table's peer rows", p.stdout + p.stderr)


def refusals(d):
    ok_doc = peer_doc()
    dup = peer_doc(batches=((1, 0.01), (1, 0.02)))
    neg = peer_doc(batches=((1, -1),))
    nobatch = copy.deepcopy(ok_doc)
    del nobatch["batches"]
    kernels = {"device": "NVIDIA H200", "copy_gbs": 4000, "rows": [{"shape": "gdn", "batch": 1, "us": 9}]}
    cases = [
        ("layers", peer_doc(layers=48), SMALL, "48 layers, 3 tokens, bf16) is not this run's "
                                               "(gdn, H=16, HV=48, 128x128, 1 layer, 3 tokens"),
        ("tokens", peer_doc(tokens=1024), SMALL, "1024 tokens"),
        ("heads", peer_doc(H=32, HV=32, arch="kda"), SMALL, "its shape (kda, H=32, HV=32"),
        ("dtype", ok_doc, SMALL + ["--dtype", "fp32"], "is not this run's"),
        ("tp", ok_doc, SMALL + ["--tp", "2"], "(gdn, H=8, HV=24"),
        ("procs", ok_doc, SMALL + ["--tp", "2", "--procs"], "(gdn, H=8, HV=24"),
        ("kernels", kernels, SMALL, "not a bench decode peer file"),
        ("dup", dup, SMALL, "batches[1]: a second entry for batch 1"),
        ("neg", neg, SMALL, "batches[0].decode_s"),
        ("nobatch", nobatch, SMALL, "batches: missing"),
        ("broken", "{\"format\": ", SMALL, "not valid JSON"),
    ]
    for name, doc, args, want in cases:
        path = write(d, name + ".json", doc)
        p = run([MAP] + args + ["--peer", path],
                env=dict(ENV, STEPQ_PROGRESS="lines", STEPQ_PROGRESS_INTERVAL="0"))
        lines = p.stderr.strip().splitlines()
        check(p.returncode == 2 and len(lines) == 1 and
              lines[0].startswith("stepq bench decode: --peer %s: " % path) and want in lines[0] and
              p.stdout == "",
              "bench decode --peer (%s): refused in one line before any work" % name,
              "rc %d, %r" % (p.returncode, p.stderr))
    missing = os.path.join(d, "none.json")
    p = run([MAP] + SMALL + ["--peer", missing])
    check(p.returncode == 2 and p.stderr.startswith("stepq bench decode: --peer %s: cannot open it"
                                                    % missing) and p.stdout == "",
          "bench decode --peer: a missing file in one line", p.stderr)


STAND_IN_GDN = '''
import torch


def _check(q, k, v, beta, S):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert T == 1 and k.shape == q.shape and beta.shape == (B, 1, HV) and HV % H == 0
    assert S.dtype == torch.float32 and S.shape == (B, HV, K, V) and S.is_contiguous()
    assert q.dtype == k.dtype == v.dtype == beta.dtype
    return B, H, HV, K, V


def step(q, k, v, decay, beta, S):
    """One token, in fp32: S <- decay S; S <- S + k (beta (v - S^T k))^T; o = S^T q K^-1/2."""
    B, H, HV, K, V = _check(q, k, v, beta, S)
    rep = HV // H
    f = lambda x: x.float()[:, 0]
    qn = torch.nn.functional.normalize(f(q), dim=-1).repeat_interleave(rep, 1) * K ** -0.5
    kn = torch.nn.functional.normalize(f(k), dim=-1).repeat_interleave(rep, 1)
    S = S * decay
    u = f(beta)[..., None] * (f(v) - torch.einsum("bhkv,bhk->bhv", S, kn))
    S = S + kn[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, qn)[:, None].to(v.dtype), S


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False):
    assert use_qk_l2norm_in_kernel and output_final_state and g.shape == beta.shape
    assert bool((g.float() < 0).all())
    o, S = step(q, k, v, g.float()[:, 0].exp()[..., None, None], beta, initial_state)
    return o, S
'''

STAND_IN_KDA = '''
from fla.ops.gated_delta_rule import step


def fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=None, inplace_final_state=True,
                            use_qk_l2norm_in_kernel=False, out=None):
    assert use_qk_l2norm_in_kernel and inplace_final_state and out.shape == v.shape
    assert g.shape == v.shape[:3] + (q.shape[3],) and bool((g.float() < 0).all())
    o, S = step(q, k, v, g.float()[:, 0].exp()[..., None], beta, initial_state)
    initial_state.copy_(S)
    out.copy_(o)
    return out, initial_state
'''

RUNNER = '''
import sys, time
import torch


class Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 1e3 * (end.t - self.t)


torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda: "stand-in CPU"
torch.cuda.mem_get_info = lambda: (1 << 34, 1 << 34)
torch.cuda.synchronize = lambda: None
torch.cuda.empty_cache = lambda: None
torch.cuda.Event = Event
sys.path.insert(0, sys.argv[1])
import bench_peer_fla as m
m.DEVICE = "cpu"
sys.argv = ["bench_peer_fla.py"] + sys.argv[2:]
sys.exit(m.main())
'''


def stand_in(d):
    if subprocess.run([TORCH_PY, "-c", "import torch"], capture_output=True).returncode:
        print("skip bench_peer_fla.py's decode loop on a stand-in fla: no torch for %s" % TORCH_PY)
        return
    fla = os.path.join(d, "fla-stand-in")
    for sub in ("fla/ops/gated_delta_rule", "fla/ops/kda"):
        os.makedirs(os.path.join(fla, sub))
    write(fla, "fla/__init__.py", '__version__ = "stand-in"\n')
    write(fla, "fla/ops/__init__.py", "")
    write(fla, "fla/ops/gated_delta_rule/__init__.py", STAND_IN_GDN)
    write(fla, "fla/ops/kda/__init__.py", "")
    write(fla, "fla/ops/kda/fused_recurrent.py", STAND_IN_KDA)
    runner = write(d, "runner.py", RUNNER)
    for name, peer_args, run_args, want in (
            ("gdn", ["--decode", "tiny-gdn", "--layers", "2", "--batch", "2,1"],
             ["tiny-gdn", "--layers", "2", "--batch", "1,2,4"], {1: True, 2: True, 4: False}),
            ("kda", ["--heads", "2,2,1,kda", "--batch", "2"],
             ["kimi-linear-48b-a3b", "--tp", "16", "--layers", "1", "--batch", "2"], {2: True})):
        out = os.path.join(d, "stand-in-%s.json" % name)
        p = subprocess.run([TORCH_PY, runner, os.path.dirname(SCRIPT), "--fla", fla, "--tokens", "3",
                            "--json", out] + peer_args, capture_output=True, text=True, timeout=300)
        try:
            doc = json.load(open(out))
            ok = (p.returncode == 0 and doc["format"] == "stepq-bench-decode-peer" and
                  doc["fla_version"] == "stand-in" and LABEL in p.stdout and
                  all(b["decode_s"] > 0 and len(b["run_s"]) == 3 and b["output_checksum"] > 0
                      for b in doc["batches"]))
        except (OSError, ValueError, KeyError) as e:
            print(e)
            ok = False
        check(ok, "bench_peer_fla.py decode mode (%s) on a stand-in fla" % name,
              p.stdout[-400:] + p.stderr[-1500:])
        if not ok:
            continue
        q = run(run_args + ["--backend", "host", "--tokens", "3", "--peer", out, "--json"])
        try:
            rows = rows_of(json.loads(q.stdout))
            ok = q.returncode == 0 and all(rows[b][LABEL]["ran"] == w for b, w in want.items())
        except (ValueError, KeyError, TypeError) as e:
            print(e)
            ok = False
        check(ok, "bench decode --peer accepts bench_peer_fla.py's file (%s)" % name,
              q.stdout[-300:] + q.stderr)


def main():
    shapes()
    with tempfile.TemporaryDirectory() as d:
        with_peer(d)
        refusals(d)
        stand_in(d)
    return 1 if failed() else 0


if __name__ == "__main__":
    sys.exit(main())
