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
            requests whose prompt was prefilled before; every request's greedy
            tokens and logits against the same request run alone (B = 1) with
            the same map, fed the batched run's tokens; no slot leaked, pool
            stats back to their start. Each --batching-map map in turn
            (default stepq@4, then fp32 as the control: it shows how far
            the model's own batched arithmetic moves logits, which a
            quantized map can turn into flipped codes). The JSON keeps,
            per request compared, whether it came through a prefix fork,
            its largest logit difference (and after the prefill, where both
            runs are B = 1), the first position past the tolerance and the
            first token mismatch: where a request parts from its alone run.
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
                   help="compare only the first N requests (by id) with their alone run (0: all; the alone "
                        "runs are B = 1 decode steps, the slowest part of the check)")
    g.add_argument("--batching-map", default="stepq@4,fp32",
                   help="maps NAME (comma list) run through the same workload one after another (default "
                        "stepq@4,fp32: the fp32 map is the control that bounds the model's own batch-dependent "
                        "arithmetic, judged by --fp32-tol and no token mismatch)")
    g.add_argument("--batching-dtype", choices=["fp32", "bf16"], default="fp32")
    g.add_argument("--batching-tol", type=float, default=1e-2,
                   help="largest max abs logit difference to the alone run that passes (default 1e-2: a "
                        "quantized map turns the batched GEMMs' last-bit differences into code flips; a slot "
                        "or copy-on-write bug moves logits by O(1); with the fp32 map expect ~1e-5)")
    g.add_argument("--batching-mismatch-frac", type=float, default=1e-3,
                   help="largest fraction of positions whose alone argmax differs from the batched token")
    g = p.add_argument_group("drift")
    g.add_argument("--methods", default=",".join(METHODS), help="maps NAME (NAME.json in --maps), comma list")
    g.add_argument("--streams", type=int, default=16)
    g.add_argument("--prefill", type=int, default=512)
    g.add_argument("--decode", type=int, default=1536)
    g.add_argument("--offset", type=int, default=0, help="byte offset of the first stream (as nll_eval.py)")
    g.add_argument("--model-dtype", choices=["bf16", "fp32"], default="bf16", help="model dtype of drift and greedy")
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


def check_batching(env, a):
    """The batching check for every map of --batching-map; passes when each passes."""
    names = [n.strip() for n in a.batching_map.split(",") if n.strip()]
    res, mds = {"maps": {}}, []
    for name in names:
        tight = name == "fp32"
        r, md = batching_one(env, a, name, a.fp32_tol if tight else a.batching_tol,
                             0.0 if tight else a.batching_mismatch_frac)
        res["maps"][name] = r
        mds.append("### %s\n\n%s" % (name, md))
    res["pass"] = all(r["pass"] for r in res["maps"].values())
    return res, "\n".join(mds)


def batching_one(env, a, name, tol, mismatch_frac):
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
    log("batching: continuous run %.1f s, %d steps, up to %d rows, %d prefills, %d prefix forks, %d track copies; "
        "running each request alone" % (t_cb, step, max_batch, prefills, forks, track_copies))
    # The same requests alone, on a pool of their own with the same map.
    ref_pool = env.pool(model, path, 2)
    t1 = time.time()
    worst, mean_sum, n_pos, mism, diverged, firsts, per_req = 0.0, 0.0, 0, 0, 0, [], []
    alone = sorted(reqs, key=lambda r: r.rid)[:a.alone or len(reqs)]
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
        per_req.append({"rid": r.rid, "forked": r.rid in forked, "prompt": len(r.prompt), "n_new": r.n_new,
                        "max_abs_logit_diff": dpos.max().item(), "prefill_logit_diff": dpos[0].item(),
                        "first_over_tol": int(over[0]) if over.numel() else None,
                        "first_mismatch": int(ne[0]) if ne.numel() else None})
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
           "mismatch_frac": mismatch_frac}
    res["pass"] = (worst <= tol and mism <= mismatch_frac * n_pos and not leaked
                   and stats_equal and closed)
    log("batching: max |logit difference| to alone %.3g (after the prefill %.3g), %d token mismatches (%d requests, "
        "%d of them forked), %d slots leaked, stats equal %s: %s"
        % (worst, res["prefill_logit_diff"], mism, diverged, res["forked_with_mismatch"], len(leaked), stats_equal,
           "PASS" if res["pass"] else "FAIL"))
    md = ("| check | value |\n|---|---:|\n"
          "| requests (sharing a prompt) | %d (%d) |\n| decode steps, largest batch | %d, %d |\n"
          "| prefills, prefix forks, track copies | %d, %d, %d |\n"
          "| requests compared with their alone run | %d |\n"
          "| max abs logit diff vs alone | %.3g (<= %g) |\n| mean abs logit diff | %.3g |\n"
          "| token mismatches (requests) | %d of %d (%d) |\n"
          "| slots leaked | %d |\n| pool stats at the end = at the start | %s |\n"
          "| seconds batched / alone | %.1f / %.1f |\n\n"
          "Continuous batching through one %s pool (%d slots = 5 x %d running, extra_buffer), model %s: %s.\n"
          % (len(reqs), a.share_groups * a.share_size, step, max_batch, prefills, forks, track_copies, len(alone),
             worst,
             tol, res["mean_abs_logit_diff"], mism, n_pos, diverged, len(leaked), "yes" if stats_equal else "NO", t_cb, res["seconds_alone"],
             name, start["capacity"], R, a.batching_dtype, "PASS" if res["pass"] else "FAIL"))
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
    return {"meta": meta, "results": table}, md


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
