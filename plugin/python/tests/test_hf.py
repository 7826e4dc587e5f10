"""stepq.hf, the transformers cache: what needs no torch (the transformers
names, the scripts' loader of them, the served-path script's arguments and
workload, the import error without torch) everywhere; with torch and
transformers (the GPU host) and the tiny-gdn / tiny-kda checkpoints
(STEPQ_SHARED, ./shared or ../shared beside the source tree), generate()
through a StepqCache against transformers' own cache on both, the batch
surgery of a scheduler (extend_rows, select_rows, trim_left, fork) against
each request alone with the fp32 map, and the refusals of a map for another
model and of a batch that does not fit the slots."""

import os
import subprocess
import sys

import _harness

import stepq
from stepq import hf_names

SCRIPTS = _harness.data("tools", "scripts")


def _run(args, env_extra=None, code=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    cmd = [sys.executable] + (["-c", code] if code is not None else args)
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, cwd=_harness.SOURCE_ROOT)


def test_every_kernel_name_has_a_role():
    for arch, (pre, dec) in hf_names.KERNELS.items():
        assert all(hf_names.kernel_role(n) == "prefill" for n in pre), arch
        assert all(hf_names.kernel_role(n) == "decode" for n in dec), arch
    assert {hf_names.kernel_role(n) for n in hf_names.LAYER_ATTRS} == {"prefill", "decode"}
    with _harness.raises(hf_names.HFNamesError, match="neither a prefill nor a decode kernel"):
        hf_names.kernel_role("softmax")
    assert issubclass(hf_names.HFNamesError, LookupError)


def test_a_config_without_the_fields_is_named():
    class Cfg:
        hidden_size = 8
        linear_conv_kernel_dim = 4
    with _harness.raises(hf_names.HFNamesError, match="linear_num_key_heads"):
        hf_names.model_shape(Cfg())


def test_the_scripts_load_the_names_without_the_library():
    code = ("import sys; sys.path.insert(0, %r); import hf_names\n"
            "assert hf_names.kernel_role('recurrent_kimi_delta_attention') == 'decode'\n"
            "assert 'stepq' not in sys.modules\n"
            "print('ok', hf_names.HFNamesError.__module__)" % SCRIPTS)
    r = _run(None, {"STEPQ_LIBRARY": "/nonexistent/libstepq.so", "PYTHONPATH": ""}, code)
    assert r.returncode == 0 and r.stdout.startswith("ok _stepq_hf_names"), r.stdout


def test_the_scripts_share_the_package_module_once_it_is_imported():
    code = ("import sys; sys.path.insert(0, %r); import stepq.hf_names as a; import hf_names\n"
            "assert hf_names.HFNamesError is a.HFNamesError\nprint('ok')" % SCRIPTS)
    r = _run(None, None, code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout


def test_stepq_hf_without_torch_is_an_import_error_that_says_so():
    r = _run(None, None, "import sys; sys.modules['torch'] = None\nimport stepq.hf")
    assert r.returncode != 0 and "ImportError" in r.stdout and "needs torch" in r.stdout, r.stdout


def test_served_path_help_and_bad_checks_need_no_torch():
    script = os.path.join(SCRIPTS, "served_path.py")
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [%r] + %%r; "
            "runpy.run_path(%r, run_name='__main__')" % (script, script))
    r = _run(None, None, code % (["--help"],))
    assert r.returncode == 0 and "--check" in r.stdout and "batching" in r.stdout, r.stdout
    r = _run(None, None, code % (["--model", "m", "--check", "fp32,nonsense"],))
    assert r.returncode == 2 and "nonsense" in r.stdout, r.stdout
    r = _run(None, None, code % (["--model", "/nonexistent"],))
    assert r.returncode == 1 and "config.json" in r.stdout, r.stdout


def test_served_path_workload_shares_prompts_and_respects_the_ranges():
    sys.path.insert(0, SCRIPTS)
    try:
        import served_path
    finally:
        sys.path.remove(SCRIPTS)
    a = served_path.parse_args(["--model", "m", "--requests", "40", "--share-groups", "5", "--share-size", "3",
                                "--prompt-min", "10", "--prompt-max", "50", "--new-min", "4", "--new-max", "9"])
    data = bytes(range(256)) * 40
    reqs = served_path.make_workload(a, data)
    assert len(reqs) == 40 and sorted(r.rid for r in reqs) == list(range(40))
    assert all(10 <= len(r.prompt) <= 50 and 4 <= r.n_new <= 9 for r in reqs)
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    groups = {}
    for r in reqs:
        if r.group is not None:
            groups.setdefault(r.group, []).append(r)
    assert sorted(len(g) for g in groups.values()) == [3] * 5
    assert all(all(x.prompt == g[0].prompt for x in g) for g in groups.values())
    assert served_path.make_workload(a, data)[7].prompt == reqs[7].prompt  # seeded


# --- with torch, transformers and the tiny model -------------------------------------------

def _shared(name="tiny-gdn"):
    for root in (os.environ.get("STEPQ_SHARED"), _harness.data("shared"), _harness.data("..", "shared")):
        if root and os.path.isfile(os.path.join(root, "models", name, "config.json")):
            return root
    return None


def _model(name="tiny-gdn"):
    try:
        import torch
        import transformers
    except ImportError as e:
        _harness.skip("torch and transformers are needed (%s)" % e)
    if not transformers.__version__.split(".")[0].isdigit() or int(transformers.__version__.split(".")[0]) < 5:
        _harness.skip("transformers %s: stepq.hf needs transformers 5" % transformers.__version__)
    root = _shared(name)
    if root is None:
        _harness.skip("no %s checkpoint (set STEPQ_SHARED, or put shared/ beside the source tree)" % name)
    import stepq.hf
    from transformers import AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, "models", name),
                                                 dtype=torch.float32).to(dev).eval()
    return torch, stepq.hf, model, dev


def _pool(hf, model, name, size, model_name="tiny-gdn"):
    try:
        return hf.open_pool(model, _harness.data("config", "calibrated", model_name, name), size=size)
    except stepq.StepqError as e:
        if e.name in ("STEPQ_ENOTSUP", "STEPQ_ENODEV"):
            _harness.skip("no pool on the model's device: %s" % e)
        raise


def _prompts(torch, dev):
    text = [b"The President said that the ", b"In the year of our Lord one "]
    return torch.tensor([list(t) for t in text], device=dev)


def _generate_through_the_fp32_map(name):
    torch, hf, model, dev = _model(name)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    pool = _pool(hf, model, "fp32.json", 4, name)
    ids = _prompts(torch, dev)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        own = model.generate(ids, **kw)
        with hf.StepqCache(model, pool) as cache:
            got = model.generate(ids, past_key_values=cache, **kw)
            n = len(hf.model_layer_ids(model))
            assert cache.kernel_calls["prefill"] == n and cache.kernel_calls["decode"] >= n * 20, cache.kernel_calls
            assert pool.stats()["in_use"] == 2
    assert pool.stats()["in_use"] == 0
    assert torch.equal(own, got), (own[:, ids.shape[1]:], got[:, ids.shape[1]:])
    pool.close()


def test_generate_through_the_fp32_map_gives_transformers_tokens():
    _generate_through_the_fp32_map("tiny-gdn")


def test_generate_on_kda_through_the_fp32_map_gives_transformers_tokens():
    _generate_through_the_fp32_map("tiny-kda")


def _batched_rows_match_alone(name):
    """The scheduler's batch surgery with the fp32 map: two prompts of different lengths prefilled
    apart, joined (extend_rows: left padding, its attention mask, per-row position_ids), decoded
    together, the shorter one kept alone (select_rows, trim_left), and a prefix fork decoded on
    its own; every row's logits as the same request run alone, teacher-forced."""
    torch, hf, model, dev = _model(name)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    pool = _pool(hf, model, "fp32.json", 8, name)
    text = b"The President said that the Congress of the United States shall meet in December "
    lens, steps, together = (21, 13), 6, 3
    starts = (0, 5)
    prompts = [list(text[s:s + n]) for s, n in zip(starts, lens)]
    feeds = [list(text[s + n:s + n + steps]) for s, n in zip(starts, lens)]

    def tensor(rows):
        return torch.tensor(rows, device=dev)

    def decode_alone(cache, i, first):
        lg = [first]
        for j in range(steps):
            out = model(input_ids=tensor([[feeds[i][j]]]), position_ids=tensor([[lens[i] + j]]),
                        past_key_values=cache, use_cache=True)
            lg.append(out.logits[0, -1])
        return torch.stack(lg)

    def alone(i):
        with hf.StepqCache(model, pool) as cache:
            out = model(input_ids=tensor([prompts[i]]), past_key_values=cache, use_cache=True)
            return decode_alone(cache, i, out.logits[0, -1])

    with torch.no_grad():
        ref = [alone(0), alone(1)]
        caches, got = [], [[], []]
        for i in range(2):
            cache = hf.StepqCache(model, pool)
            out = model(input_ids=tensor([prompts[i]]), past_key_values=cache, use_cache=True)
            got[i].append(out.logits[0, -1])
            caches.append(cache)
        fork = caches[1].fork()
        batch = caches[0]
        assert batch.extend_rows(caches[1]) == (0, lens[0] - lens[1])
        mask = torch.ones((2, lens[0]), dtype=torch.long, device=dev)
        mask[1, :lens[0] - lens[1]] = 0
        pos, rows = tensor(list(lens)), [0, 1]
        for j in range(steps):
            if j == together:
                batch.select_rows([1])
                rows, mask, pos = [1], mask[1:], pos[1:]
                n = mask.shape[1] - (lens[1] + j)
                assert n == lens[0] - lens[1], n
                batch.trim_left(n)
                mask = mask[:, n:]
            B = len(rows)
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
            out = model(input_ids=tensor([[feeds[r][j]] for r in rows]), attention_mask=mask,
                        position_ids=pos.view(B, 1), past_key_values=batch, use_cache=True)
            for b, r in enumerate(rows):
                got[r].append(out.logits[b, -1])
            pos = pos + 1
        assert batch.batch_rows == 1 and batch.get_seq_length() == lens[1] + steps
        forked = decode_alone(fork, 1, got[1][0])
        batch.release()
        fork.release()
    assert pool.stats()["in_use"] == 0
    pool.close()
    for what, a, b in (("row 0 (the longer prompt)", torch.stack(got[0]), ref[0][:together + 1]),
                       ("row 1 (padded, then kept alone)", torch.stack(got[1]), ref[1]),
                       ("the fork of row 1's prefix", forked, ref[1])):
        assert a.shape == b.shape, (what, a.shape, b.shape)
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= 1e-4, "%s: %s logits %.3g from the request alone (per position: %s)" % (
            name, what, diff, (a.float() - b.float()).abs().amax(-1).tolist())


def test_batch_surgery_keeps_every_row_as_alone():
    _batched_rows_match_alone("tiny-gdn")


def test_batch_surgery_keeps_every_row_as_alone_on_kda():
    _batched_rows_match_alone("tiny-kda")


def test_generate_through_a_packed_map_keeps_its_slots_healthy():
    torch, hf, model, dev = _model()
    pool = _pool(hf, model, "stepq@6.json", 2)
    ids = _prompts(torch, dev)
    with torch.no_grad(), hf.StepqCache(model, pool) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones_like(ids))
        assert tuple(out.shape) == (2, ids.shape[1] + 16)
        assert cache.health() == [0, 0]
    pool.close()


def test_a_map_for_another_model_and_a_batch_larger_than_the_slots_are_refused():
    torch, hf, model, dev = _model()
    with _harness.raises(ValueError, match="kda"):
        hf.open_pool(model, _harness.data("config", "calibrated", "tiny-kda", "fp32.json"), size=2)
    pool = _pool(hf, model, "fp32.json", 2)
    ids = _prompts(torch, dev)
    slot = pool.alloc(1)
    cache = hf.StepqCache(model, pool, slot)
    with torch.no_grad(), _harness.raises(ValueError, match="2 rows"):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    pool.free(slot)
    with _harness.raises(ValueError, match="not an allocated slot id"):
        hf.StepqCache(model, pool, [0])
    pool.close()


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))
