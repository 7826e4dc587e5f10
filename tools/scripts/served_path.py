#!/usr/bin/env python3
"""Served-path measurements of stepq's transformers cache (stepq.hf) on a GDN or KDA checkpoint.

Runs on the GPU host (torch + transformers 5; the model on --device, the
pools on the same device). Every recurrent state lives in a stepq StatePool
and reaches the model through stepq.hf.StepqCache: prefill through the
model's own chunk kernel and one pack, every decode token through the pool's
fused decode step. Checks (--check, comma-separated; default all):

  fp32      the fp32 map vs transformers' own (fp32-state) cache: max abs
            logit difference over the teacher-forced decode steps (model in
            fp32, TF32 off; target <= --fp32-tol), and generate() with each
            cache giving the same greedy tokens.
  batching  continuous batching: --requests requests (random prompt lengths,
            arrival steps and new-token counts; groups of them share a
            prompt) admitted and retired through one pool sized by SGLang's
            extra_buffer reservation (5 slots per running request: the
            working slot, 2 ping-pong track slots, and radix-cache prefix
            snapshots from the rest), one batched decode forward over the
            running set per step, prefix copy-on-write (StepqCache.fork) for
            requests whose prompt was prefilled before. Each --batching-map
            map in turn (default stepq@4, then fp32 as the control).
            Replay at the stepq boundary (the pass criterion): for the
            requests replayed (--replay, default all), the batched run records every
            StatePool.decode call's rows of their working slots (inputs and
            output, moved to the host) and each one's page right after its
            admission and right before its free; each request is then
            replayed at B = 1 on a second pool with the same map, from its
            admission page, on exactly the recorded inputs in order, and
            every output must equal the batched one bit for bit and the
            final page the pre-free page byte for byte: the pool gives a
            slot the same bits whatever else is in the batch. No model
            takes part in the replay. Also judged: no slot leaked, pool stats
            back to their start, the pool closes clean.
            End to end: every compared request's greedy tokens and logits
            against the same request run alone (B = 1) through the model
            with the same map, fed the batched run's tokens. With the fp32
            map this is judged too (--fp32-tol, no token mismatch): it
            measures the model's own batch variance (cuBLAS matmuls of
            another batch size differ in the last bits). With a quantized
            map it is reported only (against --batching-tol and
            --batching-mismatch-frac): those last-bit differences flip
            quantization codes and the flips propagate, so it shows the
            model's batch variance amplified by quantization, not a fault of
            the pool. The JSON keeps the replay's report ("replay") and, per
            request compared, whether it came through a prefix fork, its
            replay result, its largest logit difference (and after the
            prefill, where both runs are B = 1), the first position past the
            tolerance and the first token mismatch: where a request parts
            from its alone run.
  drift     teacher-forced NLL through the served path, the streams and the
            table of nll_eval.py (same slicing, same definitions, same
            columns), every method of --methods side by side in one batch.
  greedy    --greedy-tokens greedy tokens from --greedy-prompts prompts with
            generate() per method: the fraction identical to transformers'
            own fp32-state run and the first position where they part.

Progress goes to stderr; a markdown table per check to stdout (and
--markdown); everything to --json.
"""
import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CHECKS = ("fp32", "batching", "drift", "greedy")
METHODS = ("fp32", "bf16", "fp8", "uniform@4", "uniform@6", "dsq@4", "spatial@4", "temporal@4", "stepq@4",
           "stepq@6")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="transformers checkpoint directory (tiny-gdn, tiny-kda)")
    p.add_argument("--text", default=os.path.join("shared", "data", "wikitext2-test.txt"),
                   help="evaluation text (default shared/data/wikitext2-test.txt)")
    p.add_argument("--maps", help="directory of the precision maps NAME.json (default "
                                  "config/calibrated/<model directory name>)")
    p.add_argument("--check", default=",".join(CHECKS), help="comma list of %s (default all)" % ", ".join(CHECKS))
    p.add_argument("--json", help="write every result here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--device", default="cuda")
    p.add_argument("--library", help="libstepq.so (default $STEPQ_LIBRARY, else build-gpu/ or build/ of the "
                                     "repository)")
    p.add_argument("--quick", action="store_true", help="small sizes everywhere: a smoke test of the plumbing")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("fp32")
    g.add_argument("--fp32-streams", type=int, default=4)
    g.add_argument("--fp32-prefill", type=int, default=512)
    g.add_argument("--fp32-decode", type=int, default=512)
    g.add_argument("--fp32-tol", type=float, default=1e-4)
    g.add_argument("--fp32-generate", type=int, default=64, help="greedy tokens of the generate() comparison")
    g = p.add_argument_group("batching")
    g.add_argument("--requests", type=int, default=64)
    g.add_argument("--prompt-min", type=int, default=64)
    g.add_argument("--prompt-max", type=int, default=1024)
    g.add_argument("--new-min", type=int, default=128)
    g.add_argument("--new-max", type=int, default=1024)
    g.add_argument("--share-groups", type=int, default=8, help="prompts shared by --share-size requests each")
    g.add_argument("--share-size", type=int, default=3)
    g.add_argument("--max-running", type=int, default=24,
                   help="SGLang's max_running_requests: the pool has 5 x this many slots (extra_buffer)")
    g.add_argument("--arrival-gap", type=float, default=6.0, help="mean decode steps between arrivals")
    g.add_argument("--track-interval", type=int, default=64,
                   help="copy the working slot into a ping-pong track slot every N tokens (0: never)")
    g.add_argument("--alone", type=int, default=0,
                   help="compare with their alone run through the model only the first N requests (by id) (0: all; "
                        "the alone runs are B = 1 decode steps through the model, the slowest part of the check)")
    g.add_argument("--replay", type=int, default=0,
                   help="replay at the stepq boundary only the first N requests (by id) (0: all; cheap: no model, "
                        "but the record of their decode inputs is kept on the host, about 12-20 KB per request, "
                        "token and recurrent layer on tiny-gdn / tiny-kda)")
    g.add_argument("--batching-map", default="stepq@4,fp32",
                   help="maps NAME (comma list) run through the same workload one after another (default "
                        "stepq@4,fp32: the fp32 map is the control that measures the model's own batch-dependent "
                        "arithmetic; its end-to-end comparison is judged by --fp32-tol and no token mismatch)")
    g.add_argument("--batching-dtype", choices=["fp32", "bf16"], default="fp32")
    g.add_argument("--batching-tol", type=float, default=1e-2,
                   help="quantized maps: the max abs logit difference to the alone run that the table and JSON "
                        "report as within or over (end_to_end_within), and the per-request first_over_tol; not a "
                        "pass criterion (the replay is): a quantized map turns the batched GEMMs' last-bit "
                        "differences into code flips (default 1e-2)")
    g.add_argument("--batching-mismatch-frac", type=float, default=1e-3,
                   help="quantized maps: the fraction of positions whose alone argmax differs from the batched "
                        "token that the table and JSON report as within or over; not a pass criterion")
    g = p.add_argument_group("drift")
    g.add_argument("--methods", default=",".join(METHODS), help="maps NAME (NAME.json in --maps), comma list")
    g.add_argument("--streams", type=int, default=16)
    g.add_argument("--prefill", type=int, default=512)
    g.add_argument("--decode", type=int, default=1536)
    g.add_argument("--offset", type=int, default=0, help="byte offset of the first stream (as nll_eval.py)")
    g.add_argument("--model-dtype", choices=["bf16", "fp32"], default="bf16", help="model dtype of drift and greedy")
    g.add_argument("--compare-nll", action="append", default=[], metavar="FILE",
                   help="nll_eval.py's table of the same streams (its --json, or its --markdown): each method in "
                        "both is compared, served excess minus the table's, within one of the table's standard "
                        "errors or not (repeatable: the first file naming a method is used)")
    g = p.add_argument_group("greedy")
    g.add_argument("--greedy-prompts", type=int, default=16)
    g.add_argument("--greedy-prompt-len", type=int, default=256)
    g.add_argument("--greedy-tokens", type=int, default=512)
    g.add_argument("--greedy-offset", type=int, default=600000, help="byte offset of the first prompt")
    a = p.parse_args(argv)
    a.checks = [c.strip() for c in a.check.split(",") if c.strip()]
    bad = [c for c in a.checks if c not in CHECKS]
    if bad or not a.checks:
        p.error("--check: %s not among %s" % (", ".join(bad) or "nothing", ", ".join(CHECKS)))
    a.method_list = [m.strip() for m in a.methods.split(",") if m.strip()]
    if "fp32" not in a.method_list:
        p.error("--methods must include fp32 (the reference of the excess NLL)")
    if a.quick:
        a.fp32_streams, a.fp32_prefill, a.fp32_decode, a.fp32_generate = 2, 64, 32, 16
        a.requests, a.prompt_min, a.prompt_max, a.new_min, a.new_max = 10, 16, 96, 8, 40
        a.share_groups, a.share_size, a.max_running, a.arrival_gap = 2, 3, 4, 3.0
        a.track_interval = 8
        a.streams, a.prefill, a.decode = 4, 64, 256
        a.greedy_prompts, a.greedy_prompt_len, a.greedy_tokens = 4, 32, 32
    if a.maps is None:
        a.maps = os.path.join("config", "calibrated", os.path.basename(os.path.normpath(a.model)))
    for name in ("requests", "prompt_min", "new_min", "max_running", "streams", "prefill", "decode",
                 "greedy_prompts", "greedy_prompt_len", "greedy_tokens", "fp32_streams", "fp32_prefill",
                 "fp32_decode"):
        if getattr(a, name) < 1:
            p.error("--%s must be >= 1" % name.replace("_", "-"))
    if a.new_min < 2:
        p.error("--new-min must be >= 2 (the first token comes from the prefill, the rest from decode steps)")
    if a.prompt_max < a.prompt_min or a.new_max < a.new_min:
        p.error("--prompt-max / --new-max must be >= --prompt-min / --new-min")
    if a.share_groups * a.share_size > a.requests:
        p.error("--share-groups x --share-size is more than --requests")
    if a.decode < 256 and not a.quick:
        p.error("--decode must be >= 256 (the table's first/last 256 columns)")
    return a


def log(msg):
    print("served_path: %s" % msg, file=sys.stderr, flush=True)


def find_library(a):
    if a.library:
        os.environ["STEPQ_LIBRARY"] = a.library
    if not os.environ.get("STEPQ_LIBRARY"):
        for b in ("build-gpu", "build"):
            path = os.path.join(ROOT, b, "libstepq.so")
            if os.path.exists(path):
                os.environ["STEPQ_LIBRARY"] = path
                break
    sys.path.insert(0, os.path.join(ROOT, "plugin", "python"))


def map_paths(a, names):
    paths = {}
    for n in names:
        path = os.path.join(a.maps, n + ".json")
        if not os.path.isfile(path):
            raise SystemExit("served_path: no map %s (method %s; --maps %s)" % (path, n, a.maps))
        paths[n] = path
    return paths


class Env:
    """torch, transformers, stepq.hf and the model loader, imported once (after --help)."""

    def __init__(self, a):
        find_library(a)
        import torch
        import transformers
        import stepq
        import stepq.hf
        sys.path.insert(0, HERE)
        import nll_eval  # after stepq.hf: its hf_names is the package's module
        self.torch, self.transformers, self.stepq, self.hf, self.nll_eval = torch, transformers, stepq, stepq.hf, \
            nll_eval
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.a = a
        self.models = {}

    def model(self, dtype):
        if dtype not in self.models:
            from transformers import AutoModelForCausalLM
            torch = self.torch
            t0 = time.time()
            m = AutoModelForCausalLM.from_pretrained(self.a.model, dtype={"fp32": torch.float32,
                                                                          "bf16": torch.bfloat16}[dtype])
            self.models[dtype] = m.to(self.a.device).eval()
            log("loaded %s as %s (%s) in %.1f s" % (self.a.model, type(m).__name__, dtype, time.time() - t0))
        return self.models[dtype]

    def pool(self, model, path, size, **kw):
        return self.hf.open_pool(model, path, size=size, **kw)


def forward(model, ids, cache, **kw):
    return model(input_ids=ids, past_key_values=cache, use_cache=True, **kw)


# ----------------------------------------------------------------------------- fp32

def check_fp32(env, a):
    torch, hf = env.torch, env.hf
    model = env.model("fp32")
    S, P, D = a.fp32_streams, a.fp32_prefill, a.fp32_decode
    ids = torch.tensor(env.nll_eval.text_streams(a.text, S, P, D, a.offset, "served_path"), device=a.device)
    path = map_paths(a, ["fp32"])["fp32"]
    pool = env.pool(model, path, S)

    def run(cache):
        with torch.no_grad():
            out = forward(model, ids[:, :P], cache)
            cache = out.past_key_values
            pre = out.logits[:, -1].float()
            steps = torch.empty((D, S, out.logits.shape[-1]), dtype=torch.float32, device=a.device)
            for i in range(D):
                out = forward(model, ids[:, P + i:P + i + 1], cache)
                steps[i] = out.logits[:, -1].float()
        return pre, steps

    t0 = time.time()
    pre_own, own = run(None)
    with hf.StepqCache(model, pool) as cache:
        pre_sq, sq = run(cache)
        calls = dict(cache.kernel_calls)
    diff = (own - sq).abs()
    per_step = diff.amax(dim=(1, 2))
    res = {"map": path, "streams": S, "prefill": P, "decode": D, "model_dtype": "fp32",
           "max_abs_logit_diff": diff.max().item(), "prefill_logit_diff": (pre_own - pre_sq).abs().max().item(),
           "worst_step": int(per_step.argmax().item()), "logit_scale": own.abs().max().item(),
           "argmax_agree": (own.argmax(-1) == sq.argmax(-1)).float().mean().item(), "kernel_calls": calls,
           "tol": a.fp32_tol}
    n_layers = len(hf.model_layer_ids(model))
    if calls != {"prefill": n_layers, "decode": n_layers * D}:
        raise SystemExit("served_path: fp32: the StepqCache saw %s recurrent-layer calls, expected %d prefill and "
                         "%d decode: the routing does not see every step" % (calls, n_layers, n_layers * D))
    # generate() with each cache, the same greedy tokens.
    G = a.fp32_generate
    with torch.no_grad():
        kw = dict(max_new_tokens=G, min_new_tokens=G, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids[:, :P]))
        s_own = model.generate(ids[:, :P], **kw)
        with hf.StepqCache(model, pool) as cache:
            s_sq = model.generate(ids[:, :P], past_key_values=cache, **kw)
    s_own, s_sq = s_own[:, P:], s_sq[:, P:]
    res["generate_tokens"] = G
    res["generate_tokens_equal"] = (s_own == s_sq).float().mean().item() if s_own.shape == s_sq.shape else 0.0
    res["pass"] = res["max_abs_logit_diff"] <= a.fp32_tol and res["generate_tokens_equal"] == 1.0
    res["seconds"] = time.time() - t0
    pool.close()
    log("fp32: max |logit difference| %.3g over %d steps x %d streams (prefill %.3g), generate() tokens equal "
        "%.3f: %s" % (res["max_abs_logit_diff"], D, S, res["prefill_logit_diff"], res["generate_tokens_equal"],
                      "PASS" if res["pass"] else "FAIL"))
    md = ("| check | value | target |\n|---|---:|---:|\n"
          "| max abs logit diff, %d decode steps x %d streams | %.3g | <= %g |\n"
          "| max abs logit diff after the prefill | %.3g | |\n"
          "| argmax agreement | %.4f | |\n"
          "| generate(): greedy tokens equal (%d tokens) | %.4f | 1 |\n\n"
          "fp32 map through StepqCache vs transformers' own cache (fp32 state), model in fp32, TF32 off: %s.\n"
          % (D, S, res["max_abs_logit_diff"], a.fp32_tol, res["prefill_logit_diff"], res["argmax_agree"], G,
             res["generate_tokens_equal"], "PASS" if res["pass"] else "FAIL"))
    return res, md


# ----------------------------------------------------------------------------- batching

class Req:
    def __init__(self, rid, prompt, group, n_new, arrival):
        self.rid, self.prompt, self.group, self.n_new, self.arrival = rid, prompt, group, n_new, arrival


def make_workload(a, data):
    """The requests: prompt byte strings at random offsets of the text (share groups: one prompt for
    several requests), new-token counts, arrival steps (exponential gaps), in arrival order."""
    rng = random.Random(a.seed)
    prompts = []
    n_unique = a.requests - a.share_groups * (a.share_size - 1)
    for _ in range(n_unique):
        n = rng.randint(a.prompt_min, a.prompt_max)
        o = rng.randrange(0, len(data) - n)
        prompts.append(list(data[o:o + n]))
    # Requests 0 .. share_groups * share_size - 1 use the shared prompts 0 .. share_groups - 1.
    plan = []
    for gi in range(a.share_groups):
        plan.extend([gi] * a.share_size)
    plan.extend(range(a.share_groups, n_unique))
    rng.shuffle(plan)
    reqs, t = [], 0.0
    for rid, pi in enumerate(plan):
        t += rng.expovariate(1.0 / a.arrival_gap) if a.arrival_gap > 0 else 0.0
        reqs.append(Req(rid, prompts[pi], pi if pi < a.share_groups else None,
                        rng.randint(a.new_min, a.new_max), int(t)))
    return reqs


def run_alone(env, model, pool, req, tokens):
    """One request alone (B = 1) through StepqCache on a fresh slot, fed the tokens the batched run
    chose (teacher-forced: a near-tie that the two runs break differently costs one position, not the
    rest of the request): the logits of every position [n_new, V], on the host."""
    torch, hf = env.torch, env.hf
    dev = env.a.device
    feed = tokens.to(dev)
    slot = pool.alloc(1)
    try:
        cache = hf.StepqCache(model, pool, slot)
        with torch.no_grad():
            out = forward(model, torch.tensor([req.prompt], device=dev), cache)
            logits = torch.empty((req.n_new, out.logits.shape[-1]), dtype=torch.float32, device=dev)
            logits[0] = out.logits[0, -1].float()
            pos = torch.tensor([[len(req.prompt)]], device=dev)
            for j in range(1, req.n_new):
                out = forward(model, feed[j - 1].view(1, 1), cache, position_ids=pos)
                logits[j] = out.logits[0, -1].float()
                pos = pos + 1
    finally:
        pool.free(slot)
    return logits.cpu()


def stats_view(s):
    return {k: v for k, v in s.items() if k not in ("high_water", "n_alloc", "n_free")}


# ----------------------------------------------------------------------------- replay at the stepq boundary
#
# What the pool itself must guarantee under continuous batching: a slot's decode step gives the same bits
# whatever else is in the batch. The batched run records, for the requests it tracks, every
# StatePool.decode call's rows of those requests (inputs and output, on the host) and each request's
# working-slot page right after its admission and right before it is freed; the replay loads the
# admission page into a slot of a second pool, calls decode at B = 1 on exactly the recorded inputs in
# order, and compares every output and the final page bit for bit. No model takes part in the replay.

# decode()'s per-request tensors, by their names in StatePool.decode (hf passes g as a and beta as b).
ROW_ARGS = ("q", "k", "v", "a", "b")


class NumpyIO:
    """The array side of recording and replay for numpy arrays (a host-backend pool)."""

    def __init__(self):
        import numpy
        self.np = numpy

    def slot_list(self, ids):
        return [int(s) for s in self.np.asarray(ids).reshape(-1)]

    def rows(self, x, idx):
        return x[idx]

    def to_host(self, x):
        return self.np.array(x, copy=True)

    def host(self, fields):
        return {n: self.to_host(x) for n, x in fields.items()}

    def stack(self, xs):
        return self.np.ascontiguousarray(self.np.concatenate(xs))

    def device(self, x):
        return self.np.ascontiguousarray(x)

    def ids(self, slot):
        return self.np.array([slot], dtype=self.np.int32)

    def zeros_like(self, x):
        return self.np.zeros_like(x)

    def bits(self, x):
        x = self.np.ascontiguousarray(x)
        return x.view({1: self.np.uint8, 2: self.np.uint16, 4: self.np.uint32,
                       8: self.np.uint64}[x.dtype.itemsize])

    def values(self, x):
        return self.np.asarray(x, dtype=self.np.float64)


class TorchIO:
    """The array side of recording and replay for torch tensors: rows go to the host (CPU tensors) in one
    transfer per decode call, and back to `device` (the pool's) for the replay."""

    def __init__(self, torch, device):
        self.torch, self.dev = torch, torch.device(device)

    def slot_list(self, ids):
        return [int(s) for s in ids.tolist()] if hasattr(ids, "tolist") else [int(s) for s in ids]

    def rows(self, x, idx):
        return x[idx]

    def to_host(self, x):
        return x.detach().cpu()

    def host(self, fields):
        """The tensors of one call (one dtype: decode's rule) in one device-to-host copy."""
        torch = self.torch
        if len({x.dtype for x in fields.values()}) != 1:
            return {n: self.to_host(x) for n, x in fields.items()}
        names = list(fields)
        n = fields[names[0]].shape[0]
        flat = torch.cat([fields[k].reshape(n, -1) for k in names], dim=1).cpu()
        out, o = {}, 0
        for k in names:
            w = fields[k][0].numel()
            out[k] = flat[:, o:o + w].reshape(fields[k].shape)
            o += w
        return out

    def stack(self, xs):
        return self.torch.cat(xs).to(self.dev).contiguous()

    def device(self, x):
        return x.to(self.dev).contiguous()

    def ids(self, slot):
        return self.torch.tensor([slot], dtype=self.torch.int32, device=self.dev)

    def zeros_like(self, x):
        return self.torch.zeros(x.shape, dtype=x.dtype, device=self.dev)

    def bits(self, x):
        import numpy
        torch = self.torch
        x = x.detach().contiguous().cpu()
        as_int = {1: (torch.uint8, numpy.uint8), 2: (torch.int16, numpy.uint16), 4: (torch.int32, numpy.uint32),
                  8: (torch.int64, numpy.uint64)}[x.element_size()]
        return x.view(as_int[0]).numpy().view(as_int[1])

    def values(self, x):
        return x.detach().cpu().double().numpy()


class DecodeRecorder:
    """The batched run's record of the tracked requests (rids): the working slot of each running tracked
    request (join at admission, leave before the free: a freed slot may come back to another request),
    their admission and pre-free pages, and every decode call's rows of their slots.

    calls[rid] is a list, in call order, of dicts: layer, step (the request's decode step: calls of that
    layer before this one), the inputs ROW_ARGS and out as rows [1, ...] on the host, and the call's
    per-layer arguments (A_log, dt_bias on the host or None; scale, l2norm, beta_sigmoid)."""

    def __init__(self, rids, io):
        self.io = io
        self.tracked = set(rids)
        self.slot_rid = {}  # working slot -> rid, tracked requests running now
        self.admitted, self.freed = {}, {}  # rid -> page [1, page_bytes] (numpy uint8)
        # rid -> the slot's health word (STEPQ_HEALTH_* bits, OR-ed by the kernels) at admission / before the free
        self.admitted_health, self.freed_health = {}, {}
        self.calls = {rid: [] for rid in self.tracked}
        self.steps = {rid: {} for rid in self.tracked}  # rid -> layer -> calls so far
        self.nbytes = 0  # host bytes of the recorded rows

    def join(self, rid, slot, pool):
        """A request admitted on working slot `slot` of `pool`, after its prefill or prefix fork: for a
        tracked one, the slot now maps to it and its page is read (get_cpu_copy). Untracked requests
        are ignored."""
        if rid not in self.tracked:
            return
        if slot in self.slot_rid:
            raise RuntimeError("replay recorder: slot %d joins for request %d while request %d holds it"
                               % (slot, rid, self.slot_rid[slot]))
        if rid in self.admitted:
            raise RuntimeError("replay recorder: request %d admitted twice" % rid)
        self.slot_rid[slot] = rid
        self.admitted[rid] = pool.get_cpu_copy([slot])
        self.admitted_health[rid] = pool.health([slot])[0]

    def leave(self, rid, slot, pool):
        """A request about to free its working slot `slot`: for a tracked one, the page is read and the
        slot no longer maps to it."""
        if rid not in self.tracked:
            return
        if self.slot_rid.get(slot) != rid:
            raise RuntimeError("replay recorder: request %d leaves slot %d, which maps to %s"
                               % (rid, slot, self.slot_rid.get(slot)))
        del self.slot_rid[slot]
        self.freed[rid] = pool.get_cpu_copy([slot])
        self.freed_health[rid] = pool.health([slot])[0]

    def record(self, args, out):
        """One decode call: args are its bound arguments (by StatePool.decode's parameter names), out
        what it returned. The rows of tracked slots go to the host; other rows are not looked at."""
        slots = self.io.slot_list(args["cache_indices"])
        rows = [(i, self.slot_rid[s]) for i, s in enumerate(slots) if s in self.slot_rid]
        if not rows:
            return
        idx = [i for i, _ in rows]
        fields = {n: self.io.rows(args[n], idx) for n in ROW_ARGS}
        fields["out"] = self.io.rows(out, idx)
        h = self.io.host(fields)
        extra = {n: None if args.get(n) is None else self.io.to_host(args[n]) for n in ("A_log", "dt_bias")}
        layer = int(args["layer"])
        for j, (_, rid) in enumerate(rows):
            steps = self.steps[rid]
            call = {n: h[n][j:j + 1] for n in h}
            call.update(extra, layer=layer, step=steps.get(layer, 0), scale=args.get("scale"),
                        l2norm=args.get("l2norm", True), beta_sigmoid=args.get("beta_sigmoid"))
            steps[layer] = steps.get(layer, 0) + 1
            self.calls[rid].append(call)
        self.nbytes += sum(int(x.numel() * x.element_size()) if hasattr(x, "element_size") else int(x.nbytes)
                           for x in h.values())


def record_decode(pool, recorder):
    """Wraps pool.decode on this instance (the class and other pools untouched): each call runs, then
    the recorder sees its arguments bound to decode()'s parameter names and its output. Returns a
    function that removes the wrapper."""
    import inspect
    real = pool.decode
    sig = inspect.signature(real)

    def decode(*args, **kwargs):
        out = real(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        recorder.record(bound.arguments, out)
        return out

    decode.__doc__ = real.__doc__
    pool.decode = decode

    def unwrap():
        if pool.__dict__.get("decode") is decode:
            del pool.decode
    return unwrap


def first_bit_difference(want, got, io):
    """want, got: arrays of one shape. (number of elements whose bits differ, the flat index of the
    first, its two values); index and values None when every bit agrees."""
    wb, gb = io.bits(want).reshape(-1), io.bits(got).reshape(-1)
    if wb.shape != gb.shape:
        raise ValueError("replay: shapes %s and %s" % (tuple(want.shape), tuple(got.shape)))
    ne = (wb != gb).nonzero()[0]
    if not ne.size:
        return 0, None, None, None
    i = int(ne[0])
    return int(ne.size), i, float(io.values(want).reshape(-1)[i]), float(io.values(got).reshape(-1)[i])


def page_region(layout, offset):
    """Where byte `offset` of a page lies, in words (layer and head of a state block, a conv state)."""
    H = layout["n_local_heads"]
    for b, (o, n) in enumerate(zip(layout["block_offset"], layout["block_bytes"])):
        if o <= offset < o + n:
            return "layer %d head %d (byte %d of the block)" % (b // H, b % H, offset - o)
    for L, o in enumerate(layout["conv_offset"]):
        if o <= offset < o + layout["conv_bytes_per_layer"]:
            return "conv state of layer %d" % L
    return "outside the state blocks and conv states"


def replay_one(pool, slot, calls, io):
    """Runs one request's recorded calls at B = 1 on `slot` (its admission page loaded there): the
    batched outputs and the replayed ones, each stacked in call order [len(calls), ...] on the pool's
    device. Inputs go to the device once, stacked; each call reads its row [c:c+1] (contiguous, as the
    recorded rows)."""
    x = {n: io.stack([c[n] for c in calls]) for n in ROW_ARGS}
    want = io.stack([c["out"] for c in calls])
    out = io.zeros_like(want)
    ids = io.ids(slot)
    for c, call in enumerate(calls):
        A_log = None if call["A_log"] is None else io.device(call["A_log"])
        dt_bias = None if call["dt_bias"] is None else io.device(call["dt_bias"])
        pool.decode(call["layer"], *(x[n][c:c + 1] for n in ROW_ARGS), A_log, dt_bias, cache_indices=ids,
                    out=out[c:c + 1], scale=call["scale"], l2norm=call["l2norm"],
                    beta_sigmoid=call["beta_sigmoid"])
    return want, out


def replay(pool, recorder, io, expected_steps=None):
    """Replays every tracked request that went through admission and retirement on `pool` (a second
    pool with the same map, one free slot needed), in rid order, and compares bitwise: each call's
    output with the batched one, the final page with the pre-free page, and the health word: the
    replay starts from a reset word (load_cpu_copy resets it), so the admission word OR the
    replay's must equal the batched slot's before its free (the kernels OR bits into it; a bit that
    only one run raised means that run saw a non-finite input, state or output, or a saturation,
    that the other did not). expected_steps: rid -> the decode steps the request ran (each layer
    should have that many calls), or None.

    Returns the report: requests, calls, elements (output elements compared), outputs_identical,
    differing_elements, differing_calls, pages_identical, requests_differing (rids), incomplete (rids
    whose calls are not expected_steps per layer, or that never left), first_difference (of the outputs:
    rid, step, layer, call, element, index, batched, replayed, or None), first_page_difference (rid,
    byte, batched, replayed, where, or None), health_identical, first_health_difference (rid,
    admitted, batched, replayed: the words, or None), and per_request {rid: (outputs identical,
    pages identical, health identical)}."""
    layout = pool.layout()
    rep = {"requests": 0, "calls": 0, "elements": 0, "differing_elements": 0, "differing_calls": 0,
           "requests_differing": [], "incomplete": [], "first_difference": None,
           "first_page_difference": None, "first_health_difference": None, "per_request": {}}
    slot = pool.alloc(1)
    if slot is None:
        raise RuntimeError("replay: no free slot in the replay pool")
    slot = slot[0]
    try:
        for rid in sorted(recorder.tracked):
            calls = recorder.calls[rid]
            if rid not in recorder.admitted or rid not in recorder.freed:
                rep["incomplete"].append(rid)
                continue
            if expected_steps is not None:
                n = expected_steps[rid]
                if len(calls) != n * pool.n_layers or any(
                        recorder.steps[rid].get(L, 0) != n for L in range(pool.n_layers)):
                    rep["incomplete"].append(rid)
            pool.load_cpu_copy(recorder.admitted[rid], [slot])
            out_ok = True
            if calls:
                want, got = replay_one(pool, slot, calls, io)
                per = int(want[0].numel() if hasattr(want[0], "numel") else want[0].size)
                n_diff, i, bv, rv = first_bit_difference(want, got, io)
                rep["elements"] += per * len(calls)
                if n_diff:
                    out_ok = False
                    rep["differing_elements"] += n_diff
                    wb, gb = io.bits(want).reshape(len(calls), -1), io.bits(got).reshape(len(calls), -1)
                    rep["differing_calls"] += int((wb != gb).any(axis=1).sum())
                    if rep["first_difference"] is None:
                        import numpy
                        c, e = divmod(i, per)
                        index = [int(v) for v in numpy.unravel_index(e, tuple(want.shape[1:]))]
                        rep["first_difference"] = {
                            "rid": rid, "step": calls[c]["step"], "layer": calls[c]["layer"], "call": c,
                            "element": e, "index": index, "batched": bv, "replayed": rv}
            page = pool.get_cpu_copy([slot])
            h0, hb, hr = recorder.admitted_health[rid], recorder.freed_health[rid], pool.health([slot])[0]
            health_ok = (h0 | hr) == hb
            if not health_ok and rep["first_health_difference"] is None:
                rep["first_health_difference"] = {"rid": rid, "admitted": h0, "batched": hb, "replayed": hr}
            n_diff, i, bv, rv = first_bit_difference(recorder.freed[rid], page, NumpyIO())
            page_ok = n_diff == 0
            if not page_ok and rep["first_page_difference"] is None:
                rep["first_page_difference"] = {"rid": rid, "byte": i, "bytes_differing": n_diff,
                                                "batched": int(bv), "replayed": int(rv),
                                                "where": page_region(layout, i)}
            if not (out_ok and page_ok and health_ok):
                rep["requests_differing"].append(rid)
            rep["per_request"][rid] = (out_ok, page_ok, health_ok)
            rep["requests"] += 1
            rep["calls"] += len(calls)
    finally:
        pool.free([slot])
    rep["outputs_identical"] = rep["differing_elements"] == 0
    rep["pages_identical"] = all(p for _, p, _ in rep["per_request"].values())
    rep["health_identical"] = all(h for _, _, h in rep["per_request"].values())
    rep["identical"] = (rep["outputs_identical"] and rep["pages_identical"] and rep["health_identical"]
                        and not rep["incomplete"])
    return rep


def replay_summary(rep):
    """The report in one line for the log and the table."""
    s = ("%d requests, %d decode calls (%d output elements) at B = 1: outputs %s, final pages %s, "
         "health words %s"
         % (rep["requests"], rep["calls"], rep["elements"],
            "identical" if rep["outputs_identical"] else "DIFFER in %d elements of %d calls"
            % (rep["differing_elements"], rep["differing_calls"]),
            "identical" if rep["pages_identical"] else "DIFFER",
            "identical" if rep.get("health_identical", True) else "DIFFER"))
    if rep["incomplete"]:
        s += "; %d requests with an incomplete record (%s)" % (len(rep["incomplete"]),
                                                               ", ".join(map(str, rep["incomplete"][:8])))
    d = rep["first_difference"]
    if d:
        s += "; first: request %d step %d layer %d element %s, batched %r, replayed %r" % (
            d["rid"], d["step"], d["layer"], d["index"], d["batched"], d["replayed"])
    p = rep["first_page_difference"]
    if p:
        s += "; first page byte: request %d byte %d (%s), batched %d, replayed %d" % (
            p["rid"], p["byte"], p["where"], p["batched"], p["replayed"])
    h = rep.get("first_health_difference")
    if h:
        s += "; first health word: request %d, batched 0x%x, replayed 0x%x (admitted 0x%x)" % (
            h["rid"], h["batched"], h["replayed"], h["admitted"])
    return s


def check_batching(env, a):
    """The batching check for every map of --batching-map; passes when each passes."""
    names = [n.strip() for n in a.batching_map.split(",") if n.strip()]
    res, mds = {"maps": {}}, []
    for name in names:
        tight = name == "fp32"
        r, md = batching_one(env, a, name, a.fp32_tol if tight else a.batching_tol,
                             0.0 if tight else a.batching_mismatch_frac, end_to_end=tight)
        res["maps"][name] = r
        mds.append("### %s\n\n%s" % (name, md))
    res["pass"] = all(r["pass"] for r in res["maps"].values())
    return res, "\n".join(mds)


def batching_one(env, a, name, tol, mismatch_frac, end_to_end):
    """One map through the continuous-batching workload. Passes when the replay at the stepq boundary
    is identical, no slot leaked, the stats are back and the pool closes clean; with end_to_end (the
    fp32 map) also when every request's logits are within tol of its alone run and at most
    mismatch_frac of the positions pick another token. Otherwise tol and mismatch_frac are reported
    thresholds only: the end-to-end numbers are the model's batch variance as quantization amplifies
    it."""
    torch, hf = env.torch, env.hf
    dev = a.device
    model = env.model(a.batching_dtype)
    path = map_paths(a, [name])[name]
    with open(a.text, "rb") as f:
        data = f.read()
    reqs = make_workload(a, data)
    R = a.max_running
    pool = env.pool(model, path, None, policy="extra_buffer", max_running_requests=R)
    log("batching: %d requests (%d share %d prompts), prompts %d-%d bytes, %d-%d new tokens, %d running at most, "
        "pool %d slots (%s), map %s" % (len(reqs), a.share_groups * a.share_size, a.share_groups,
                                         a.prompt_min, a.prompt_max, a.new_min, a.new_max, R, pool.size,
                                         "extra_buffer", name))
    # The requests compared alone, and the decode calls of their slots recorded for the replay.
    alone = sorted(reqs, key=lambda r: r.rid)[:a.alone or len(reqs)]
    replayed = sorted(reqs, key=lambda r: r.rid)[:a.replay or len(reqs)]
    io = TorchIO(torch, "cpu" if pool.device == "cpu" else "cuda:%d" % pool.device[1])
    recorder = DecodeRecorder([r.rid for r in replayed], io)
    unwrap = record_decode(pool, recorder)
    start = pool.stats()
    held = set()  # every slot the scheduler holds, for the leak check

    def alloc(n):
        ids = pool.alloc(n)
        if ids is not None:
            held.update(ids)
        return ids

    def free(ids):
        pool.free(ids)
        held.difference_update(ids)

    pending = {}  # share group -> requests not yet admitted
    for r in reqs:
        if r.group is not None:
            pending[r.group] = pending.get(r.group, 0) + 1
    snaps = {}  # share group -> (cache over the snapshot slot, prefill logits [V])
    queue = list(reqs)
    rows = []  # per batch row: dict(req, produced, kv_len, working, track, ntrack)
    batch = None  # the StepqCache of the running rows
    mask = last = pos = None
    step_logits, step_rows, step_tokens = [], [], []
    first = {}  # rid -> (logits [V] on device, token)
    forks = prefills = track_copies = 0
    forked = set()  # rids admitted through a prefix fork
    step, max_batch = 0, 0
    t0 = time.time()
    done = 0
    with torch.no_grad():
        while done < len(reqs):
            # Admission (FIFO): a free place among the R running requests and the request's reservation
            # from the pool (working + 2 track slots, + 1 prefix snapshot when it is the first of a group
            # with more to come).
            while queue and queue[0].arrival <= step and len(rows) < R:
                r = queue[0]
                snap = snaps.get(r.group) if r.group is not None else None
                make_snap = r.group is not None and snap is None and pending[r.group] > 1
                ids = alloc(3 + make_snap)
                if ids is None:
                    break
                queue.pop(0)
                working, track = ids[0], ids[1:3]
                if snap is not None:
                    c = snap[0].fork([working])  # prefix copy-on-write: pages and transformers tensors
                    lg = snap[1]
                    forks += 1
                    forked.add(r.rid)
                else:
                    c = hf.StepqCache(model, pool, [working])
                    out = forward(model, torch.tensor([r.prompt], device=dev), c)
                    lg = out.logits[0, -1].float()
                    prefills += 1
                    if make_snap:
                        snaps[r.group] = (c.fork([ids[3]]), lg.clone())
                if r.group is not None:
                    pending[r.group] -= 1
                    if pending[r.group] == 0 and r.group in snaps:
                        sc, _ = snaps.pop(r.group)
                        free(sc.slots)
                tok = lg.argmax().view(1)
                first[r.rid] = (lg, tok)
                Tp = len(r.prompt)
                if batch is None:
                    batch, mask = c, torch.ones((1, Tp), dtype=torch.long, device=dev)
                    last, pos = tok, torch.tensor([Tp], device=dev)
                else:
                    pad_b, pad_c = batch.extend_rows(c)
                    mask = torch.cat([torch.nn.functional.pad(mask, (pad_b, 0)),
                                      torch.nn.functional.pad(torch.ones((1, Tp), dtype=torch.long, device=dev),
                                                              (pad_c, 0))])
                    last = torch.cat([last, tok])
                    pos = torch.cat([pos, torch.tensor([Tp], device=dev)])
                rows.append({"req": r, "produced": 1, "kv_len": Tp, "working": working, "track": track,
                             "ntrack": 0})
                recorder.join(r.rid, working, pool)  # the page the replay starts from
            if not rows:
                if not queue:
                    break
                if queue[0].arrival <= step:
                    raise SystemExit("served_path: batching: request %d cannot be admitted into an idle pool "
                                     "(%d slots)" % (queue[0].rid, pool.size))
                step = queue[0].arrival
                continue
            # One decode forward over the running set.
            B = len(rows)
            max_batch = max(max_batch, B)
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
            out = model(input_ids=last.view(B, 1), attention_mask=mask, position_ids=pos.view(B, 1),
                        past_key_values=batch, use_cache=True)
            lg = out.logits[:, -1].float()
            last = lg.argmax(-1)
            pos = pos + 1
            step_logits.append(lg)
            step_tokens.append(last)
            step_rows.append([x["req"].rid for x in rows])
            for x in rows:
                x["produced"] += 1
                x["kv_len"] += 1
                if a.track_interval and (x["produced"] - 1) % a.track_interval == 0:
                    # extra_buffer tracking: the working state into the ping-pong track slots
                    pool.copy_from([x["working"]], [x["track"][x["ntrack"] % 2]])
                    x["ntrack"] += 1
                    track_copies += 1
            step += 1
            keep = [i for i, x in enumerate(rows) if x["produced"] < x["req"].n_new]
            if len(keep) < B:
                for i, x in enumerate(rows):
                    if i not in keep:
                        recorder.leave(x["req"].rid, x["working"], pool)  # the page the replay must end on
                        free([x["working"]] + x["track"])
                        done += 1
                if keep:
                    batch.select_rows(keep)
                    rows = [rows[i] for i in keep]
                    idx = torch.tensor(keep, device=dev)
                    mask, last, pos = mask[idx], last[idx], pos[idx]
                    n = mask.shape[1] - max(x["kv_len"] for x in rows)
                    if n > 0:
                        batch.trim_left(n)
                        mask = mask[:, n:]
                else:
                    rows, batch, mask, last, pos = [], None, None, None, None
            if step % 200 == 0:
                log("batching: step %d, %d running, %d queued, %d done, %.0f s"
                    % (step, len(rows), len(queue), done, time.time() - t0))
    t_cb = time.time() - t0
    unwrap()
    for sc, _ in snaps.values():
        free(sc.slots)
    end = pool.stats()
    leaked = sorted(held)
    # Every request's tokens and logits out of the batched run.
    cb = {}
    if step_logits:
        L = torch.cat(step_logits).cpu()
        T = torch.cat(step_tokens).cpu()
        k = 0
        per = {r.rid: ([], []) for r in reqs}
        for rids in step_rows:
            for rid in rids:
                per[rid][0].append(L[k])
                per[rid][1].append(int(T[k]))
                k += 1
    for r in reqs:
        lg0, tok0 = first[r.rid]
        ls, ts = per[r.rid] if step_logits else ([], [])
        cb[r.rid] = (torch.tensor([int(tok0.item())] + ts), torch.stack([lg0.cpu()] + ls))
    log("batching: continuous run %.1f s, %d steps, up to %d rows, %d prefills, %d prefix forks, %d track copies"
        % (t_cb, step, max_batch, prefills, forks, track_copies))
    # Replay at the stepq boundary: each tracked request's recorded decode calls at B = 1 on a second pool
    # from its admission page, compared bit for bit (outputs, then the page before the free).
    t2 = time.time()
    log("batching: replay at the stepq boundary: %d requests, %d decode calls recorded (%.0f MiB on the host); "
        "each replayed at B = 1 from its admission page on a second %s pool" % (
            len(recorder.tracked), sum(len(c) for c in recorder.calls.values()), recorder.nbytes / 2 ** 20, name))
    replay_pool = env.pool(model, path, 1)
    rep = replay(replay_pool, recorder, io, {r.rid: r.n_new - 1 for r in replayed})
    replay_pool.close()
    rep["recorded_bytes"] = recorder.nbytes
    rep["seconds"] = time.time() - t2
    replay_per = rep.pop("per_request")
    del recorder
    log("batching: replay: %s: %s" % (replay_summary(rep), "identical" if rep["identical"] else "DIFFERENT"))
    log("batching: running each request alone (end to end, through the model)")
    # The same requests alone, on a pool of their own with the same map.
    ref_pool = env.pool(model, path, 2)
    t1 = time.time()
    worst, mean_sum, n_pos, mism, diverged, firsts, per_req = 0.0, 0.0, 0, 0, 0, [], []
    for i, r in enumerate(alone):
        ct, cl = cb[r.rid]
        logits = run_alone(env, model, ref_pool, r, ct)
        d = (cl - logits).abs()
        worst = max(worst, d.max().item())
        mean_sum += d.mean(dim=1).sum().item()
        n_pos += r.n_new
        ne = (logits.argmax(-1) != ct).nonzero()
        mism += ne.numel()
        if ne.numel():
            diverged += 1
            firsts.append((r.rid, int(ne[0])))
        # Where a request parts from its alone run: at once (position 0 is the B = 1 prefill of both runs, 0 unless
        # the runs differ before any batching), at a batch event, or growing from last-bit differences.
        dpos = d.amax(dim=1)
        over = (dpos > tol).nonzero()
        rp = replay_per.get(r.rid, (None, None, None))  # outputs, page, health word identical
        per_req.append({"rid": r.rid, "forked": r.rid in forked, "prompt": len(r.prompt), "n_new": r.n_new,
                        "max_abs_logit_diff": dpos.max().item(), "prefill_logit_diff": dpos[0].item(),
                        "first_over_tol": int(over[0]) if over.numel() else None,
                        "first_mismatch": int(ne[0]) if ne.numel() else None,
                        "replay_outputs_identical": rp[0], "replay_pages_identical": rp[1],
                        "replay_health_identical": rp[2]})
        if (i + 1) % 8 == 0:
            el = time.time() - t1
            log("batching: %d/%d alone runs, %.0f s (%.0f s to go)" % (i + 1, len(alone), el,
                                                                       el / (i + 1) * (len(alone) - i - 1)))
    ref_pool.close()
    stats_equal = stats_view(start) == stats_view(end) and \
        end["n_alloc"] - start["n_alloc"] == end["n_free"] - start["n_free"]
    try:
        pool.close()  # refuses (STEPQ_EBUSY) while a slot is allocated
        closed = True
    except env.stepq.StepqError as e:
        closed = False
        log("batching: pool.close(): %s" % e)
        pool.close(force=True)
    res = {"map": path, "model_dtype": a.batching_dtype, "requests": len(reqs), "max_running": R,
           "pool_slots": start["capacity"], "steps": step, "max_batch": max_batch, "prefills": prefills,
           "prefix_forks": forks, "track_copies": track_copies, "tokens": sum(r.n_new for r in reqs),
           "compared_alone": len(alone), "max_abs_logit_diff": worst, "mean_abs_logit_diff": mean_sum / max(n_pos, 1),
           "token_mismatches": mism, "requests_with_mismatch": diverged, "first_mismatch": firsts[:16],
           "prefill_logit_diff": max((x["prefill_logit_diff"] for x in per_req), default=0.0),
           "forked_with_mismatch": sum(1 for x in per_req if x["forked"] and x["first_mismatch"] is not None),
           "per_request": per_req, "slots_leaked": leaked, "pool_closed_clean": closed,
           "stats_start": start, "stats_end": end, "stats_equal": stats_equal,
           "seconds_batched": t_cb, "seconds_alone": time.time() - t1, "tol": tol,
           "mismatch_frac": mismatch_frac, "replay": rep}
    within = worst <= tol and mism <= mismatch_frac * n_pos
    res["end_to_end_within"] = within  # the tolerances: pass criteria with end_to_end (fp32), else reported
    res["end_to_end_judged"] = end_to_end
    res["pass"] = (rep["identical"] and not leaked and stats_equal and closed and (within or not end_to_end))
    log("batching: end to end vs alone: max |logit difference| %.3g (after the prefill %.3g), %d token mismatches "
        "(%d requests, %d of them forked)%s; replay %s, %d slots leaked, stats equal %s, pool closed clean %s: %s"
        % (worst, res["prefill_logit_diff"], mism, diverged, res["forked_with_mismatch"],
           "" if end_to_end else " (reported: the model's batch variance amplified by quantization)",
           "identical" if rep["identical"] else "DIFFERENT", len(leaked), stats_equal, closed,
           "PASS" if res["pass"] else "FAIL"))
    if end_to_end:
        e2e = e2e_first = "end to end"
        bound = " (<= %g)" % tol
        mism_bound = "; target 0" if mismatch_frac == 0 else "; target <= %g of them" % mismatch_frac
    else:
        e2e = "end to end (reported)"
        e2e_first = "end to end, reported: the model's batch variance amplified by quantization"
        bound = " (threshold %g: %s)" % (tol, "within" if worst <= tol else "over")
        mism_bound = "; threshold %g of them: %s" % (mismatch_frac, "within" if mism <= mismatch_frac * n_pos
                                                    else "over")
    md = ("| check | value |\n|---|---:|\n"
          "| requests (sharing a prompt) | %d (%d) |\n| decode steps, largest batch | %d, %d |\n"
          "| prefills, prefix forks, track copies | %d, %d, %d |\n"
          "| requests compared with their alone run | %d |\n"
          "| replay at the stepq boundary: requests, decode calls at B = 1 | %d, %d |\n"
          "| replayed decode outputs bitwise identical (differing elements) | %s (%d of %d) |\n"
          "| final pages byte-identical (requests differing) | %s (%d) |\n"
          "| health words equal (requests differing) | %s (%d) |\n"
          "| max abs logit diff vs alone, %s | %.3g%s |\n| mean abs logit diff, %s | %.3g |\n"
          "| token mismatches (requests), %s | %d of %d (%d%s) |\n"
          "| slots leaked | %d |\n| pool stats at the end = at the start | %s |\n"
          "| pool closed clean | %s |\n"
          "| seconds batched / replay / alone | %.1f / %.1f / %.1f |\n\n"
          "Continuous batching through one %s pool (%d slots = 5 x %d running, extra_buffer), model %s: %s. "
          "Pass: every compared request's decode calls, replayed at B = 1 from its admission page on a second "
          "pool, give the batched run's outputs bit for bit and end on its page byte for byte and its health word (the pool gives a "
          "slot the same bits whatever else is in the batch), no slot leaked, the stats back to the start, the "
          "pool closed clean%s.\n"
          % (len(reqs), a.share_groups * a.share_size, step, max_batch, prefills, forks, track_copies, len(alone),
             rep["requests"], rep["calls"], "yes" if rep["outputs_identical"] else "NO", rep["differing_elements"],
             rep["elements"], "yes" if rep["pages_identical"] else "NO",
             sum(1 for o, p, h in replay_per.values() if not p),
             "yes" if rep["health_identical"] else "NO", sum(1 for o, p, h in replay_per.values() if not h),
             e2e_first, worst, bound, e2e, res["mean_abs_logit_diff"], e2e, mism, n_pos, diverged, mism_bound,
             len(leaked), "yes" if stats_equal else "NO", "yes" if closed else "NO",
             t_cb, rep["seconds"], res["seconds_alone"],
             name, start["capacity"], R, a.batching_dtype, "PASS" if res["pass"] else "FAIL",
             ", and end to end within the tolerances (the fp32 map: the model's own batch variance)" if end_to_end
             else "; the end-to-end rows are reported, not judged: the model's batched arithmetic differs from "
                  "B = 1 in the last bits (the fp32 map's rows show by how much), which flips quantization codes "
                  "that then propagate"))
    if not rep["identical"]:
        md += "\nReplay: %s.\n" % replay_summary(rep)
    return res, md


# ----------------------------------------------------------------------------- drift

def method_pools(env, model, paths, names, n):
    """One pool of n slots per method, all allocated: [(name, pool, slots)]."""
    out = []
    for name in names:
        pool = env.pool(model, paths[name], n)
        out.append((name, pool, pool.alloc(n)))
    return out


def close_pools(pools):
    for _, pool, slots in pools:
        pool.free(slots)
        pool.close()


def check_drift(env, a):
    torch, hf, ne = env.torch, env.hf, env.nll_eval
    model = env.model(a.model_dtype)
    names = a.method_list
    paths = map_paths(a, names)
    S, P, D = a.streams, a.prefill, a.decode
    ids = torch.tensor(ne.text_streams(a.text, S, P, D, a.offset, "served_path"), dtype=torch.long, device=a.device)
    M = len(names)
    # Decode predictions of one full forward (no cache), as nll_eval's teacher-forcing check.
    with torch.no_grad():
        lg = model(input_ids=ids[:, :P + D], use_cache=False).logits[:, P:]
        full_nll = -torch.log_softmax(lg.float(), dim=-1).gather(2, ids[:, P + 1:P + D + 1].unsqueeze(2)) \
            .squeeze(2).double().cpu()
        del lg
    pools = method_pools(env, model, paths, names, S)
    t0 = time.time()
    cache = hf.StepqCache.segments(model, [(pool, slots) for _, pool, slots in pools])
    idg = ids.repeat(M, 1)  # row m * S + s: method m, stream s
    nll = torch.empty((M * S, D), dtype=torch.float32, device=a.device)
    with torch.no_grad():
        forward(model, idg[:, :P], cache)
        for i in range(D):
            p = P + i
            out = forward(model, idg[:, p:p + 1], cache)
            lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            nll[:, i] = -lp.gather(1, idg[:, p + 1:p + 2]).squeeze(1)
            if (i + 1) % 256 == 0:
                log("drift: %d/%d decode steps, %.0f s" % (i + 1, D, time.time() - t0))
    nll = nll.double().cpu()
    dt = time.time() - t0
    health = cache.health()
    close_pools(pools)
    k = names.index("fp32")
    ref = nll[k * S:(k + 1) * S]
    dvf = (ref - full_nll).mean(dim=1).abs().max().item()
    if not dvf < 0.1:
        raise SystemExit("served_path: drift: the fp32 map's decode does not reproduce the full forward (%.3g "
                         "nats/byte apart): the teacher forcing is broken" % dvf)
    results = {name: {"nll": nll[m * S:(m + 1) * S], "ref": ref, "path": paths[name], "seconds": dt}
               for m, name in enumerate(names)}
    bits = {}
    for name in names:
        with env.stepq.load_map(paths[name]) as mp:
            bits[name] = mp.memory_info()["bits_per_value"]
    table = ne.excess_table(results, lambda name, path: bits[name])
    meta = {"model": a.model, "text": os.path.basename(a.text), "streams": S, "prefill": P, "decode": D,
            "offset": a.offset, "model_dtype": a.model_dtype, "decode_vs_full_fp32": dvf, "seconds": dt,
            "health_nonzero_rows": sum(1 for h in health if h)}
    log("drift: %d methods x %d streams in %.0f s; fp32 map decode vs full forward %.2e" % (M, S, dt, dvf))
    md = ne.excess_markdown(table, S, meta["text"], P, D).replace(
        "teacher-forced;", "teacher-forced through StepqCache (served path);")
    res = {"meta": meta, "results": table}
    if a.compare_nll:
        cmp = compare_nll(table, [(p, read_nll_table(p)) for p in a.compare_nll])
        res["vs_nll_eval"] = cmp
        log("drift: against nll_eval's tables: %d of %d methods within one s.e."
            % (sum(r["within_one_se"] for r in cmp["rows"]), len(cmp["rows"])))
        md += "\nAgainst nll_eval.py's table of the same streams (%s):\n\n%s" % (
            ", ".join(a.compare_nll), compare_markdown(cmp))
    return res, md


def read_nll_table(path):
    """nll_eval.py's excess NLL per method from its --json (results: method, excess, excess_se) or its
    --markdown table (| method | bits/value | NLL | excess NLL | s.e. | ...): {method: (excess, se)}."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        doc = json.loads(text)
        return {r["method"]: (float(r["excess"]), float(r["excess_se"])) for r in doc["results"]}
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[0] in ("method", "") or cells[0].startswith("---"):
            continue
        try:
            out[cells[0]] = (float(cells[3]), float(cells[4]))
        except ValueError:
            continue
    if not out:
        raise SystemExit("served_path: --compare-nll %s: no table rows (want nll_eval.py's --json or --markdown)"
                         % path)
    return out


def compare_nll(table, refs):
    """The served drift table's rows against nll_eval's (refs: [(path, {method: (excess, se)})], the first
    naming a method wins): per method in both, the difference and whether it is within the reference's
    standard error (the issue's criterion); methods absent from every reference are listed as such."""
    rows, missing = [], []
    for t in table:
        m = t["method"]
        if m == "fp32":
            continue
        src = next(((p, r[m]) for p, r in refs if m in r), None)
        if src is None:
            missing.append(m)
            continue
        path, (ex, se) = src
        d = t["excess"] - ex
        rows.append({"method": m, "served_excess": t["excess"], "served_se": t["excess_se"], "table_excess": ex,
                     "table_se": se, "difference": d, "within_one_se": abs(d) <= se, "table": path})
    return {"rows": rows, "not_in_tables": missing, "all_within": all(r["within_one_se"] for r in rows)}


def compare_markdown(cmp):
    lines = ["| method | served excess | nll_eval excess | difference | within 1 s.e. of nll_eval |",
             "|---|---:|---:|---:|---|"]
    for r in cmp["rows"]:
        lines.append("| %s | %+.5f +- %.5f | %+.5f +- %.5f | %+.5f | %s |" % (
            r["method"], r["served_excess"], r["served_se"], r["table_excess"], r["table_se"], r["difference"],
            "yes" if r["within_one_se"] else "NO"))
    tail = "\nNot in the nll_eval tables: %s.\n" % ", ".join(cmp["not_in_tables"]) if cmp["not_in_tables"] else ""
    return "\n".join(lines) + "\n" + tail


# ----------------------------------------------------------------------------- greedy

def check_greedy(env, a):
    torch, hf = env.torch, env.hf
    model = env.model(a.model_dtype)
    names = a.method_list
    paths = map_paths(a, names)
    N, Lp, G = a.greedy_prompts, a.greedy_prompt_len, a.greedy_tokens
    with open(a.text, "rb") as f:
        data = f.read()
    if a.greedy_offset + N * Lp > len(data):
        raise SystemExit("served_path: greedy: %s has %d bytes, need %d" % (a.text, len(data), a.greedy_offset + N * Lp))
    prompts = torch.tensor([list(data[a.greedy_offset + i * Lp:a.greedy_offset + (i + 1) * Lp]) for i in range(N)],
                           device=a.device)
    kw = dict(max_new_tokens=G, min_new_tokens=G, do_sample=False, pad_token_id=0)
    t0 = time.time()
    with torch.no_grad():
        ref = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)[:, Lp:].cpu()
        pools = method_pools(env, model, paths, names, N)
        cache = hf.StepqCache.segments(model, [(pool, slots) for _, pool, slots in pools])
        x = prompts.repeat(len(names), 1)
        got = model.generate(x, past_key_values=cache, attention_mask=torch.ones_like(x), **kw)[:, Lp:].cpu()
        close_pools(pools)
    dt = time.time() - t0
    if tuple(ref.shape) != (N, G) or tuple(got.shape) != (N * len(names), G):
        raise SystemExit("served_path: greedy: generate() gave %s and %s tokens, expected %d each"
                         % (tuple(ref.shape), tuple(got.shape), G))
    rows, lines = [], ["| method | tokens identical | prompts parted | first parting: min | median |",
                       "|---|---:|---:|---:|---:|"]
    for m, name in enumerate(names):
        g = got[m * N:(m + 1) * N]
        same = g == ref
        firsts = []
        for i in range(N):
            bad = (~same[i]).nonzero()
            firsts.append(int(bad[0]) if bad.numel() else None)
        parted = [f for f in firsts if f is not None]
        med = sorted(f if f is not None else G for f in firsts)[N // 2]
        rows.append({"method": name, "map": paths[name], "identical_fraction": same.float().mean().item(),
                     "prompts_parted": len(parted), "first_parting": firsts,
                     "first_parting_min": min(parted) if parted else None, "first_parting_median": med})
        lines.append("| %s | %.4f | %d/%d | %s | %s |" % (name, rows[-1]["identical_fraction"], len(parted), N,
                                                         min(parted) if parted else "-", med if parted else "-"))
    log("greedy: %d prompts x %d tokens x %d methods in %.0f s" % (N, G, len(names), dt))
    md = "\n".join(lines) + ("\n\n%d greedy tokens from %d prompts of %d bytes (%s at byte %d), generate() with "
                             "StepqCache per method vs transformers' own cache (fp32 state), model %s; median "
                             "counts a prompt that never parts as %d.\n"
                             % (G, N, Lp, os.path.basename(a.text), a.greedy_offset, a.model_dtype, G))
    return {"prompts": N, "prompt_len": Lp, "tokens": G, "model_dtype": a.model_dtype, "seconds": dt,
            "results": rows}, md


# ----------------------------------------------------------------------------- main

def main(argv=None):
    a = parse_args(argv)
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        raise SystemExit("served_path: %s has no config.json (--model)" % a.model)
    if not os.path.isfile(a.text):
        raise SystemExit("served_path: no text file %s (--text)" % a.text)
    need = set()
    if "drift" in a.checks or "greedy" in a.checks:
        need.update(a.method_list)
    if "fp32" in a.checks:
        need.add("fp32")
    if "batching" in a.checks:
        need.update(n.strip() for n in a.batching_map.split(",") if n.strip())
    map_paths(a, sorted(need))  # every map there before any GPU work
    env = Env(a)
    log("stepq %s (%s), torch %s, transformers %s, device %s" % (
        env.stepq.library_version(), env.stepq.library_path, env.torch.__version__, env.transformers.__version__,
        a.device))
    out = {"meta": {"model": a.model, "text": a.text, "maps": a.maps, "device": a.device, "quick": a.quick,
                    "checks": a.checks, "torch": env.torch.__version__,
                    "transformers": env.transformers.__version__, "stepq": env.stepq.library_version()},
           "checks": {}}
    mds = []
    t0 = time.time()
    for c in a.checks:
        t = time.time()
        log("check %s" % c)
        res, md = {"fp32": check_fp32, "batching": check_batching, "drift": check_drift,
                   "greedy": check_greedy}[c](env, a)
        out["checks"][c] = res
        res_seconds = time.time() - t
        out["checks"][c]["wall_seconds"] = res_seconds
        text = "## %s (%s, %.0f s)\n\n%s" % (c, os.path.basename(os.path.normpath(a.model)), res_seconds, md)
        print(text, flush=True)
        mds.append(text)
        if a.json:  # after every check, so an interrupted run keeps what it measured
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
    out["meta"]["seconds"] = time.time() - t0
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(mds))
    log("done in %.0f s" % (time.time() - t0))
    failed = [c for c in a.checks if out["checks"][c].get("pass") is False]
    if failed:
        log("FAILED: %s" % ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
