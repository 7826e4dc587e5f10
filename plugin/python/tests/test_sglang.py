"""stepq.sglang (the SGLang plugin) where neither torch nor SGLang is needed:
the import rules, the entry point, registration against a fake HookRegistry,
every refusal and its message, the map checks, PackedStates, and the SGLang
test runner's pieces (its stubs, the maps it writes, --static). The pool and
kernel classes need torch and SGLang: tools/scripts/sglang_tests.py runs
them on a GPU host. Checks against SGLang's source skip unless a snapshot
(tools/scripts/sglang_snapshot.sh peers/sglang, or STEPQ_SGLANG_SNAPSHOT)
is there."""

import ast
import enum
import json
import importlib.machinery
import importlib.util
import logging
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import types

import _harness

import stepq
from stepq import sglang as plugin

QWEN_MAP = _harness.data("config", "examples", "qwen3-next-80b-a3b.uniform-4.json")
RUNNER = _harness.data("tools", "scripts", "sglang_tests.py")
SNAPSHOT_SH = _harness.data("tools", "scripts", "sglang_snapshot.sh")
MIRROR = os.environ.get("SGLANG_MIRROR", "/work/.mirror/modal-projects+sglang/repo")


def _snapshot():
    d = os.environ.get("STEPQ_SGLANG_SNAPSHOT") or _harness.data("peers", "sglang")
    if not os.path.isfile(os.path.join(d, "python", "sglang", "srt", "mem_cache", "memory_pool.py")):
        _harness.skip("no SGLang snapshot at %s (tools/scripts/sglang_snapshot.sh peers/sglang)" % d)
    return d


def _python(code, **env_extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = _harness.PACKAGE_ROOT
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True)


def _sglang_importable():
    return importlib.util.find_spec("sglang") is not None


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


class FakeRegistry:
    """HookRegistry's interface as stepq.sglang uses it."""

    def __init__(self, apply=True):
        self.hooks, self._patched, self.applied = [], set(), 0
        self._apply = apply

    def register(self, target, hook, hook_type):
        self.hooks.append((target, hook, hook_type))

    def apply_hooks(self):
        self.applied += 1
        if self._apply:
            self._patched.update(t for t, _, _ in self.hooks)


def _reset_plugin():
    plugin._registered = False
    plugin._registry = None
    plugin._runtime_hooks_done = False
    plugin.hook_status.clear()


class _Env:
    def __init__(self, **values):
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- imports ---------------------------------------------------------------

def test_import_stepq_does_not_import_the_plugin_nor_the_plugin_torch_or_sglang():
    r = _python("import sys; sys.modules['torch'] = None; sys.modules['sglang'] = None\n"
                "import stepq\n"
                "assert 'stepq.sglang' not in sys.modules, 'import stepq imported stepq.sglang'\n"
                "import stepq.sglang as p\n"
                "assert p.register.__module__ == 'stepq.sglang'\n"
                "print('ok')")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


def test_the_classes_need_torch_and_sglang_and_say_so():
    r = _python("import sys; sys.modules['torch'] = None; sys.modules['sglang'] = None\n"
                "import stepq.sglang as p\n"
                "for name in ('StepqMambaPool', 'StepqSlotAllocator', 'StepqLinearAttnKernel'):\n"
                "    try:\n"
                "        getattr(p, name)\n"
                "    except ImportError as e:\n"
                "        assert 'torch and SGLang' in str(e), e\n"
                "    else:\n"
                "        raise SystemExit(name + ' did not raise')\n"
                "try:\n"
                "    p.nonexistent\n"
                "except AttributeError:\n"
                "    print('ok')\n")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


def test_register_without_sglang_is_a_clear_import_error_only_when_the_map_is_set():
    code = ("import sys; sys.modules['sglang'] = None\n"
            "import stepq.sglang as p\n"
            "assert p.register() == []\n"   # STEPQ_MAP unset: inert, imports nothing
            "import os; os.environ['STEPQ_MAP'] = 'x.json'\n"
            "try:\n"
            "    p.register()\n"
            "except ImportError as e:\n"
            "    assert 'sglang.srt.plugins.hook_registry' in str(e), e\n"
            "    print('ok')\n")
    r = _python(code, STEPQ_MAP="")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout


def test_the_entry_point_is_declared_and_resolves_to_register():
    with open(os.path.join(_harness.PACKAGE_ROOT, "pyproject.toml")) as f:
        text = f.read()
    try:
        import tomllib
    except ImportError:
        tomllib = None
    if tomllib is not None:
        eps = tomllib.loads(text)["project"]["entry-points"]["sglang.srt.plugins"]
    else:
        block = text.split('[project.entry-points."sglang.srt.plugins"]', 1)[1].split("\n[", 1)[0]
        eps = dict(re.findall(r'^(\w+)\s*=\s*"([^"]+)"', block, re.M))
    assert eps == {"stepq": plugin.ENTRY_POINT}, eps
    assert pkgutil.resolve_name(plugin.ENTRY_POINT) is plugin.register


# --- registration ------------------------------------------------------------

def test_register_is_inert_without_stepq_map():
    _reset_plugin()
    reg = FakeRegistry()
    with _Env(STEPQ_MAP=None):
        assert plugin.register(reg, HookType) == []
    assert reg.hooks == [] and not plugin._registered


def test_register_hooks_the_pool_once():
    _reset_plugin()
    reg = FakeRegistry()
    with _Env(STEPQ_MAP=QWEN_MAP):
        targets = plugin.register(reg, HookType)
        assert plugin.register(reg, HookType) == []  # once per process
    assert targets == [plugin.T_REQ_POOL_INIT, plugin.T_INIT_MAMBA_POOL, plugin.T_MAMBA_SIZING]
    kinds = {t: k for t, _, k in reg.hooks}
    assert kinds == {plugin.T_REQ_POOL_INIT: HookType.BEFORE,
                     plugin.T_INIT_MAMBA_POOL: HookType.AROUND,
                     plugin.T_MAMBA_SIZING: HookType.AROUND}, kinds
    # No REPLACE on mamba_pool_cls: the registry would rebind MambaPool everywhere.
    assert all("mamba_pool_cls" not in t and k is not HookType.REPLACE for t, _, k in reg.hooks)
    with _harness.raises(TypeError, match="hook_type"):
        _reset_plugin()
        with _Env(STEPQ_MAP=QWEN_MAP):
            plugin.register(FakeRegistry())
    _reset_plugin()


def test_the_runtime_hooks_register_apply_and_report():
    _reset_plugin()
    reg = FakeRegistry(apply=False)
    with _Env(STEPQ_MAP=QWEN_MAP):
        plugin.register(reg, HookType)
    sa = types.SimpleNamespace(disaggregation_mode="prefill", disaggregation_transfer_backend="mori")
    level = plugin.logger.level
    plugin.logger.setLevel(logging.ERROR)  # the "not applied" warnings are expected here
    try:
        plugin._register_runtime_hooks(sa)
        plugin._register_runtime_hooks(sa)  # once
    finally:
        plugin.logger.setLevel(level)
    targets = [t for t, _, _ in reg.hooks[3:]]
    assert targets == [plugin.T_BACKEND_BASE_INIT, plugin.T_GDN_INIT, plugin.T_KDA_INIT,
                       plugin.T_HOST_POOL_INIT, plugin.T_PD["mori"]], targets
    assert reg.applied == 1
    assert all(plugin.hook_status[t] == "not applied" for t in targets), plugin.hook_status
    with _harness.raises(plugin.Unsupported, match="hooks were not in place"):
        plugin.PackedStates(None, 0, (3, 2, 4, 4), "torch.float32", "cuda:0").data_ptr()
    _reset_plugin()
    plain = [t for t, _, _ in plugin._runtime_hooks(None)]
    assert not any(t in plain for t in plugin.T_PD.values())
    _reset_plugin()


def test_the_hook_targets_exist_in_the_sglang_snapshot():
    py = os.path.join(_snapshot(), "python")
    targets = [plugin.T_REQ_POOL_INIT, plugin.T_INIT_MAMBA_POOL, plugin.T_BACKEND_BASE_INIT,
               plugin.T_GDN_INIT, plugin.T_KDA_INIT, plugin.T_HOST_POOL_INIT,
               plugin.T_MAMBA_SIZING] + list(plugin.T_PD.values())
    for target in targets:
        mod, cls, meth = target.rsplit(".", 2)
        path = os.path.join(py, *mod.split(".")) + ".py"
        with open(path) as f:
            tree = ast.parse(f.read())
        c = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        assert c is not None, "%s: no class %s" % (path, cls)
        assert any(isinstance(n, ast.FunctionDef) and n.name == meth for n in c.body), target


def test_the_sizing_hook_rests_on_what_sglangs_sizing_reads():
    """The sizing hook swaps KVCacheConfigurator.mambaish_config for the call: SGLang's
    _handle_max_mamba_cache must read the per-request bytes only as
    self.mambaish_config(...).mamba2_cache_params.mamba_cache_per_req (through its local
    `config`), and nothing else of the dense slot's size."""
    path = os.path.join(_snapshot(), "python", "sglang", "srt", "mem_cache", "kv_cache_configurator.py")
    with open(path) as f:
        src = f.read()
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_handle_max_mamba_cache")
    assert "config = self.mambaish_config" in ast.get_source_segment(src, fn)
    uses = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "mamba_cache_per_req"]
    assert uses and set(uses) == {"config.mamba2_cache_params.mamba_cache_per_req"}, uses
    # The dense size enters nowhere else: no other name for the config or its cache parameters.
    others = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Attribute)
              and n.attr in ("mamba2_cache_params", "mambaish_config")]
    assert set(others) <= {"config.mamba2_cache_params", "self.mambaish_config"}, others


def _method_args(path, cls, meth):
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for n in node.body:
                if isinstance(n, ast.FunctionDef) and n.name == meth:
                    a = n.args
                    return [x.arg for x in a.args + a.kwonlyargs]
    raise AssertionError("%s.%s not in %s" % (cls, meth, path))


def test_the_pool_class_takes_what_sglang_passes():
    py = os.path.join(_snapshot(), "python")
    mp = os.path.join(py, "sglang", "srt", "mem_cache", "memory_pool.py")
    ours = _method_args(plugin.__file__, "StepqMambaPool", "__init__")
    theirs = _method_args(mp, "MambaPool", "__init__")
    assert ours == theirs, (ours, theirs)
    init = _method_args(mp, "HybridReqToTokenPool", "_init_mamba_pool")
    for name in ("device", "enable_mamba_extra_buffer", "speculative_num_draft_tokens",
                 "enable_linear_replayssm", "mamba_envelope_layout", "enable_gdn_replayssm_spec"):
        assert name in init, "the hook reads %s, _init_mamba_pool has %s" % (name, init)
    with open(mp) as f:
        src = f.read()
    assert "self.mamba_pool = self.mamba_pool_cls(" in src
    assert "self.mamba_allocator = MambaSlotAllocator(" in src
    kb = os.path.join(py, "sglang", "srt", "layers", "attention", "linear", "kernels",
                      "kernel_backend.py")
    for meth in ("decode", "extend"):
        assert _method_args(kb, "LinearAttnKernelBase", meth) == \
            _method_args(plugin.__file__, "StepqLinearAttnKernel", meth), meth
    _method_args(plugin.__file__, "StepqLinearAttnKernel", "target_verify")


# --- the hooks' refusals (fake SGLang objects) --------------------------------

def _init_mamba_pool(self, mamba_size, mamba_spec_state_size, cache_params, mamba_layer_ids, device,
                     enable_mamba_extra_buffer, speculative_num_draft_tokens=None,
                     speculative_eagle_topk=None, enable_linear_replayssm=False,
                     linear_replayssm_cache_len=16, mamba_envelope_layout=False,
                     enable_gdn_replayssm_spec=False):
    raise AssertionError("the original ran although stepq refuses this configuration")


def _around(**kw):
    args = dict(mamba_size=4, mamba_spec_state_size=4, cache_params=None, mamba_layer_ids=[0],
                device="cuda", enable_mamba_extra_buffer=False)
    args.update(kw)
    self = types.SimpleNamespace(enable_memory_saver=kw.pop("_saver", False))
    args.pop("_saver", None)
    return plugin._init_mamba_pool_around(_init_mamba_pool, self, **args)


def test_the_pool_hook_refuses_before_building_anything():
    cases = [({"enable_mamba_extra_buffer": True}, "extra-buffer"),
             ({"speculative_num_draft_tokens": 3}, "speculative decoding"),
             ({"enable_linear_replayssm": True}, "ReplaySSM"),
             ({"enable_gdn_replayssm_spec": True}, "ReplaySSM"),
             ({"mamba_envelope_layout": True}, "--enable-page-major-kv-layout"),
             ({"_saver": True}, "--enable-memory-saver"),
             ({"device": "cpu"}, "device 'cpu'"),
             ({"device": "npu:0"}, "device 'npu:0'")]
    for kw, feature in cases:
        with _harness.raises(plugin.Unsupported, name="STEPQ_ENOTSUP", match=feature):
            _around(**kw)
    with _Env(SGLANG_MOONCAKE_CUSTOM_MEM_POOL="NVLINK"):
        with _harness.raises(plugin.Unsupported, match="SGLANG_MOONCAKE_CUSTOM_MEM_POOL"):
            _around()


def test_the_pool_hook_needs_torch_and_sglang_once_nothing_is_refused():
    if _sglang_importable():
        _harness.skip("SGLang is importable here: the hook would build the pool")
    with _harness.raises(ImportError, match="torch and SGLang"):
        _around()


def test_every_refusal_names_its_feature_and_the_survey():
    e = plugin.Unsupported("--some-flag", "because", "Do this")
    assert e.name == "STEPQ_ENOTSUP" and e.feature == "--some-flag"
    s = str(e)
    assert s.startswith("STEPQ_ENOTSUP: stepq (STEPQ_MAP) does not serve --some-flag: because. "
                        "Do this") and "SGLANG.md" in s, s
    assert isinstance(e, stepq.StepqError)


def test_server_argument_refusals():
    ok = types.SimpleNamespace(disable_radix_cache=False, mamba_radix_cache_strategy="no_buffer",
                               device="cuda", pp_size=1)
    assert plugin.server_refusals(ok) == []
    assert plugin.server_refusals(object()) == []  # every attribute missing: SGLang's defaults
    cases = [({"enable_int8_mamba_checkpoint": True}, "--enable-int8-mamba-checkpoint"),
             ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
             ({"enable_unified_memory": True}, "--enable-unified-memory"),
             ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),
             ({"mamba_radix_cache_strategy": "extra_buffer"}, "extra_buffer"),
             ({"mamba_radix_cache_strategy": "extra_buffer_lazy"}, "extra_buffer_lazy"),
             ({"enable_linear_replayssm": True}, "ReplaySSM"),
             ({"enable_page_major_kv_layout": True}, "--enable-page-major-kv-layout"),
             ({"enable_memory_saver": True}, "--enable-memory-saver"),
             ({"pp_size": 2}, "--pp-size 2"),
             ({"device": "npu"}, "--device npu")]
    for kw, feature in cases:
        sa = types.SimpleNamespace(**dict(vars(ok), **kw))
        with _harness.raises(plugin.Unsupported, match=feature):
            plugin.server_refusals(sa)
    # extra_buffer without a radix cache is no track copy at all
    off = types.SimpleNamespace(**dict(vars(ok), disable_radix_cache=True,
                                       mamba_radix_cache_strategy="extra_buffer"))
    assert plugin.server_refusals(off) == []
    w = plugin.server_refusals(types.SimpleNamespace(linear_attn_decode_backend="flashinfer",
                                                     linear_attn_prefill_backend="flashinfer",
                                                     disaggregation_mode="decode",
                                                     enable_torch_compile=True))
    assert len(w) == 3, w
    assert any("--linear-attn-decode-backend flashinfer: decode runs stepq's kernel" in x
               for x in w), w
    assert not any("prefill" in x for x in w), w  # the prefill backend is kept
    assert any("same STEPQ_MAP map" in x for x in w) and any("torch-compile" in x for x in w), w


def test_subclasses_with_their_own_pool_are_refused():
    Base = type("HybridReqToTokenPool", (), {"__module__": plugin._MP,
                                             "_init_mamba_pool": lambda self: None})
    Unified = type("UnifiedHybridReqToTokenPool", (Base,), {"_init_mamba_pool": lambda self: 1})
    Decode = type("HybridMambaDecodeReqToTokenPool", (Base,), {})
    assert plugin._req_pool_init_before(Base()) is None
    assert plugin._req_pool_init_before(Decode()) is None
    with _harness.raises(plugin.Unsupported, match="--enable-unified-memory"):
        plugin._req_pool_init_before(Unified())


def test_pd_transfer_between_tp_sizes_is_refused():
    def _send_mamba_state_slice(self, *a):
        raise AssertionError("not to be called")

    with _harness.raises(plugin.Unsupported, match="different attention-TP sizes"):
        plugin._pd_slice_around(_send_mamba_state_slice, object(), 1, 2)
    calls = []

    def _send_mamba_state(self, peer_info, *a):
        calls.append(a)
        return "sent"

    mgr = types.SimpleNamespace(attn_tp_size=2)
    assert plugin._mori_send_around(_send_mamba_state, mgr,
                                    types.SimpleNamespace(decode_tp_size=2), 7) == "sent"
    with _harness.raises(plugin.Unsupported, match="different attention-TP sizes"):
        plugin._mori_send_around(_send_mamba_state, mgr, types.SimpleNamespace(decode_tp_size=4))
    assert calls == [(7,)]


# --- the map check ---------------------------------------------------------------

def _qwen_cache(**kw):
    m = stepq.load_map(QWEN_MAP)
    c = dict(is_kda=False, layer_ids=list(m.layer_ids), temporal=(32, 128, 128), conv=[(8192, 3)],
             conv_dtype="bf16", temporal_dtype="bf16", num_k_heads_per_tp=16)
    c.update(kw)
    return plugin.map_desc(m), c


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _cache_params(m, hv=32, conv=(8192, 3), nk=16, is_kda=False):
    """SGLang's Mamba2CacheParams as the plugin reads them, for the map m's layers (bf16 states)."""
    L = len(m.layer_ids)
    dense = L * (conv[0] * conv[1] * 2 + hv * 128 * 128 * 2)
    return _NS(shape=_NS(temporal=(hv, 128, 128), conv=[conv], num_k_heads_per_tp=nk),
               dtype=_NS(conv="torch.bfloat16", temporal="torch.bfloat16"),
               layers=list(m.layer_ids), is_kda=is_kda, mamba_cache_per_req=dense)


class _Configurator:
    """KVCacheConfigurator's fields that _handle_max_mamba_cache and the hook read."""

    def __init__(self, params, spec=False, ps=None, device="cuda"):
        self.mambaish_config = _NS(mamba2_cache_params=params, other="kept")
        self.spec_algorithm = _NS(is_none=lambda: not spec)
        self.server_args = _NS(max_mamba_cache_size=None, mamba_full_memory_ratio=0.9)
        self.ps, self.device, self.seen = ps, device, []


def _sglang_sizing(self, total_rest_memory):
    """The auto-sizing branch of SGLang's _handle_max_mamba_cache, its arithmetic only."""
    config = self.mambaish_config
    self.seen.append((config.other, config.mamba2_cache_params.layers))  # delegated attributes
    per_req = config.mamba2_cache_params.mamba_cache_per_req
    r = self.server_args.mamba_full_memory_ratio
    self.server_args.max_mamba_cache_size = int(total_rest_memory * r / (1 + r) * (1 << 30) // per_req)
    return total_rest_memory - self.server_args.max_mamba_cache_size * per_req / (1 << 30)


def test_the_sizing_hook_turns_the_saving_into_slots():
    """SGLang sizes the state pool from the dense slot; with the hook it sizes by stepq's page + health
    word for the same budget: 4-bit states give several times the slots, and the memory they take is
    what the pool will hold."""
    with _Env(STEPQ_MAP=QWEN_MAP), stepq.load_map(QWEN_MAP) as m:
        params = _cache_params(m)
        page = stepq.plan_pool(m, size=1)["page_bytes"]
        assert plugin.slot_bytes(params, "cpu") == (page + plugin.HEALTH_WORD_BYTES, 1)
        dense_cfg = _Configurator(params)
        rest_dense = _sglang_sizing(dense_cfg, 40.0)
        n_dense = dense_cfg.server_args.max_mamba_cache_size
        cfg = _Configurator(params, device="cpu")
        conf0 = cfg.mambaish_config
        rest = plugin._mamba_sizing_around(_sglang_sizing, cfg, 40.0)
        n = cfg.server_args.max_mamba_cache_size
        per = page + plugin.HEALTH_WORD_BYTES
        r = 0.9
        assert n == int(40.0 * r / (1 + r) * (1 << 30) // per)
        assert n > 3 * n_dense, (n, n_dense)  # uniform@4 against bf16: about 4x the slots
        assert abs((40.0 - rest) - n * per / (1 << 30)) < 1e-9 and rest > 0 and rest_dense > 0
        assert cfg.mambaish_config is conf0  # restored
        assert cfg.seen == [("kept", list(m.layer_ids))]
        # A tensor-parallel rank: its share of the heads, its rank from the configurator's ps.
        cfg4 = _Configurator(_cache_params(m, hv=8, conv=(2048, 3), nk=4), device="cpu",
                             ps=_NS(attn_tp_rank=2, attn_tp_size=4))
        plugin._mamba_sizing_around(_sglang_sizing, cfg4, 40.0)
        per4 = stepq.plan_pool(m, size=1, tp_size=4, tp_rank=2)["page_bytes"] + plugin.HEALTH_WORD_BYTES
        assert per4 < per and cfg4.server_args.max_mamba_cache_size == int(40.0 * r / (1 + r) * (1 << 30) // per4)
        # A pipeline stage: the pool holds the stage's layers (layer_info), which the map must list; the
        # checkpoint's full list is then refused by name, as the pool would refuse it.
        cfgp = _Configurator(params, device="cpu")
        cfgp.layer_info = _NS(start_layer=0, end_layer=m.layer_ids[-1] + 1)  # every layer: as TP1
        plugin._mamba_sizing_around(_sglang_sizing, cfgp, 40.0)
        assert cfgp.server_args.max_mamba_cache_size == n
        cfgp.layer_info = _NS(start_layer=0, end_layer=m.layer_ids[len(m.layer_ids) // 2])
        with _harness.raises(plugin.Unsupported, match="a pipeline stage holds only its own layers"):
            plugin._mamba_sizing_around(_sglang_sizing, cfgp, 40.0)


def test_the_sizing_hook_leaves_speculative_decoding_and_refuses_a_wrong_map_at_sizing():
    with _Env(STEPQ_MAP=QWEN_MAP), stepq.load_map(QWEN_MAP) as m:
        params = _cache_params(m)
        spec = _Configurator(params, spec=True, device="cpu")
        plugin._mamba_sizing_around(_sglang_sizing, spec, 40.0)  # the dense sizing, untouched
        assert spec.server_args.max_mamba_cache_size == int(40.0 * 0.9 / 1.9 * (1 << 30) // params.mamba_cache_per_req)
        none = _Configurator(params, device="cpu")
        none.mambaish_config = None
        with _harness.raises(AttributeError):  # SGLang's own code runs (and fails its own way)
            plugin._mamba_sizing_around(_sglang_sizing, none, 40.0)
        bad = _Configurator(_cache_params(m, is_kda=True), device="cpu")
        conf0 = bad.mambaish_config
        with _harness.raises(plugin.Unsupported, match="arch is gdn"):
            plugin._mamba_sizing_around(_sglang_sizing, bad, 40.0)
        assert bad.mambaish_config is conf0 and bad.server_args.max_mamba_cache_size is None and not bad.seen
        # The configuration is restored when SGLang's sizing itself raises.
        def boom(self, total):
            assert self.mambaish_config.mamba2_cache_params.mamba_cache_per_req < params.mamba_cache_per_req
            raise RuntimeError("Not enough GPU memory")
        ok = _Configurator(params, device="cpu")
        conf0 = ok.mambaish_config
        with _harness.raises(RuntimeError, match="Not enough GPU memory"):
            plugin._mamba_sizing_around(boom, ok, 40.0)
        assert ok.mambaish_config is conf0
    with _Env(STEPQ_MAP=None), stepq.load_map(QWEN_MAP) as m:
        with _harness.raises(stepq.StepqError, match="STEPQ_MAP"):
            plugin.slot_bytes(_cache_params(m), "cpu")
    with _Env(STEPQ_MAP="/nonexistent/map.json"), stepq.load_map(QWEN_MAP) as m:
        with _harness.raises(stepq.StepqError, match="/nonexistent/map.json"):
            plugin.slot_bytes(_cache_params(m), "cpu")


def test_check_map_accepts_the_matching_shape_and_infers_the_tp_size():
    m, c = _qwen_cache()
    assert plugin.check_map(m, c) == 1
    m, c = _qwen_cache(temporal=(8, 128, 128), conv=[(2048, 3)], num_k_heads_per_tp=4,
                       temporal_dtype="fp32")
    assert plugin.check_map(m, c) == 4
    m, c = _qwen_cache(num_k_heads_per_tp=None)
    assert plugin.check_map(m, c) == 1


def test_check_map_refuses_every_mismatch_with_the_numbers():
    cases = [({"is_kda": True}, "arch is gdn"),
             ({"layer_ids": [0, 1, 2]}, "recurrent layers [0, 1, 2]"),
             ({"temporal": (5, 128, 128)}, "5 value heads per rank"),
             ({"temporal": (32, 128, 64)}, "[HV=32, V=128, K=64]"),
             ({"num_k_heads_per_tp": 8}, "8 q/k heads per rank"),
             ({"conv": [(8192, 3), (8192, 3)]}, "2 conv state tensors"),
             ({"conv": [(8192, 4)]}, "[8192, 4] per rank"),
             ({"conv_dtype": "fp32"}, "stores the conv state as bf16"),
             ({"temporal_dtype": "fp16"}, "--mamba-ssm-dtype fp16")]
    for kw, text in cases:
        m, c = _qwen_cache(**kw)
        with _harness.raises(plugin.Unsupported, match=text):
            plugin.check_map(m, c)


# --- PackedStates ----------------------------------------------------------------

class FakeIds:
    """What _is_index_tensor recognises: a 1-D int32 tensor."""
    dtype = "torch.int32"
    shape = (3,)

    def dim(self):
        return 1


def test_packed_states_keep_the_metadata_and_refuse_the_data():
    p = plugin.PackedStates("owner", None, (36, 21, 32, 128, 128), "torch.bfloat16", "cuda:0")
    assert (p.shape, p.ndim, p.dim(), len(p), p.size(1), p.dtype) == \
        ((36, 21, 32, 128, 128), 5, 5, 36, 21, "torch.bfloat16")
    assert not p.is_contiguous()
    layer = p[3]
    assert (layer.layer, layer.shape, layer.owner) == (3, (21, 32, 128, 128), "owner")
    assert p[-1].layer == 35
    with _harness.raises(IndexError):
        p[36]
    refused = [(lambda: p[:, 1], "reading [:, 1] on mamba_cache.temporal"),
               (lambda: p.__setitem__((slice(None), 1), 2.0), "writing [:, 1] = float"),
               (lambda: layer.data_ptr(), "data_ptr() on mamba_cache.temporal[3]"),
               (lambda: layer.numel(), "numel()"),
               (lambda: layer.copy_, ".copy_"),
               (lambda: layer[1], "reading [1]"),
               (lambda: list(layer), "iterating"),
               (lambda: plugin.PackedStates.__torch_function__("f", (), (layer,)), "torch function f")]
    for fn, text in refused:
        with _harness.raises(plugin.Unsupported, name="STEPQ_ENOTSUP", match=text):
            fn()
    assert not hasattr(p, "__array_interface__")  # dunders are plain AttributeErrors
    assert "layer 3" in repr(layer)


def test_the_gather_protocol_of_the_gdn_prefill():
    layer = plugin.PackedStates("owner", None, (6, 9, 8, 128, 128), "torch.float32", "cuda:0")[2]
    ids = FakeIds()
    g = layer[ids]
    assert g.contiguous() is g and g.shape == (3, 8, 128, 128) and g.parent is layer
    with _harness.raises(plugin.Unsupported, match="no stepq kernel packed"):
        layer[ids] = g  # scattered back before a stepq kernel packed it
    g.packed = True
    layer[ids] = g  # the backend's scatter back after the stepq kernel: a no-op
    with _harness.raises(plugin.Unsupported, match="writing"):
        layer[FakeIds()] = g  # other ids
    with _harness.raises(plugin.Unsupported, match="a gather by slot"):
        g.data_ptr()


# --- the runner's pieces -----------------------------------------------------------

def _runner():
    spec = importlib.util.spec_from_file_location("sglang_tests_under_test", RUNNER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runner_help_and_usage_errors():
    r = subprocess.run([sys.executable, RUNNER, "--help"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True)
    assert r.returncode == 0 and "--sglang" in r.stdout and "baseline" in r.stdout, r.stdout
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, RUNNER, "--sglang", d], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
    assert r.returncode == 2 and "sglang_snapshot.sh" in r.stdout, r.stdout


def test_runner_stubs_import_subclass_and_raise_when_called():
    t = _runner()
    name = "stepq_no_such_module_%d" % os.getpid()
    finder = t._StubFinder([name])
    sys.meta_path.append(finder)
    try:
        mod = importlib.import_module(name + ".sub")
        Thing = mod.Thing
        assert mod.__version__ == "0.0.0"

        class Mine(Thing, tag=True):
            pass

        assert isinstance(Mine(1, x=2), Thing)          # a real subclass instantiates
        decorated = mod.jit(cache=True)(lambda: 0)    # while importing: recorded, no raise
        assert t._Stubs.calls and name + ".sub" in t._Stubs.served
        t._Stubs.strict = True
        with _harness.raises(RuntimeError, match="is a stub"):
            decorated()
        # A module imported after the tests started (a plugin building its classes on first use)
        # may still call a stub in its body, as SGLang's pydantic models call Field: recorded.
        n = len(t._Stubs.calls)
        late = name + "_late"
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, late + ".py"), "w") as f:
                f.write("from %s.sub import Field\nclass Card:\n    x = Field(default=1)\n" % name)
            sys.path.insert(0, d)
            try:
                importlib.import_module(late)
            finally:
                sys.path.remove(d)
                sys.modules.pop(late, None)
        assert len(t._Stubs.calls) == n + 1 and t._Stubs.calls[-1][0] == name + ".sub.Field", t._Stubs.calls
        with _harness.raises(RuntimeError, match="is a stub"):
            mod.Field(default=2)                     # the same stub called by test code: raises
        with _harness.raises(ModuleNotFoundError):
            importlib.import_module("stepq_no_such_module_either_%d" % os.getpid())
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k.startswith(name)]:
            del sys.modules[k]


def test_runner_stubs_a_name_an_installed_module_lacks():
    """SGLang importing a name its transformers does not have ("cannot import name X from M"):
    the probe finds (M:X, where), the stub is set on the real module, the import then passes,
    and _install_stubs applies an M:X entry the same way in the run children."""
    t = _runner()
    name = "stepq_fake_installed_%d" % os.getpid()
    mod = types.ModuleType(name)
    mod.Kept = object
    sys.modules[name] = mod
    try:
        try:
            exec("from %s import Gone" % name, {})
        except ImportError as e:
            miss = t._missing_name(e)
        else:
            raise AssertionError("the name was there")
        assert miss and miss[0] == name + ":Gone", miss
        assert t._missing_module(ImportError("x")) is None
        t._stub_name_in(name, "Gone")
        ns = {}
        exec("from %s import Gone, Kept" % name, ns)
        assert ns["Kept"] is object and isinstance(ns["Gone"], type)
        assert (name + ":Gone") in t._Stubs.served
        t._install_stubs([name + ":Other"])
        assert isinstance(mod.Other, type) and mod.Kept is object
        assert t._missing_name(ValueError("no import at all")) is None
    finally:
        del sys.modules[name]


def test_runner_msgspec_shim_builds_frozen_structs():
    """SGLang's kernel registry builds msgspec.Struct instances at import time and reads
    their fields back; the runner's shim (msgspec not installed on the GPU host) must hold
    them: fields from annotations, defaults and default factories, ClassVar left out,
    frozen instances that hash, a mutable default copied per instance."""
    import dataclasses
    import typing

    t = _runner()
    ms = t._msgspec_shim("msgspec")
    ns = {"ms": ms, "typing": typing, "ClassVar": typing.ClassVar}
    exec("class Cap(ms.Struct, frozen=True):\n"
         "    device: str\n"
         "    arch: int = 0\n"
         "    CUDA: ClassVar['Cap']\n"
         "class Spec(ms.Struct, frozen=True, gc=False):\n"
         "    op: str\n"
         "    caps: frozenset = frozenset()\n"
         "    fmt: tuple = ms.field(default_factory=tuple)\n"
         "class Bag(ms.Struct):\n"
         "    items: list = []\n", ns)
    Cap, Spec, Bag = ns["Cap"], ns["Spec"], ns["Bag"]
    Cap.CUDA = Cap(device="cuda")  # a class constant, as sglang/kernels/spec.py assigns them
    s = Spec(op="a.b", caps=frozenset({Cap.CUDA}))
    assert (s.op, s.fmt, Cap.CUDA.arch) == ("a.b", (), 0)
    assert [f.name for f in dataclasses.fields(Cap)] == ["device", "arch"]
    assert Cap("cuda") == Cap.CUDA and hash(Cap("cuda")) == hash(Cap.CUDA)
    with _harness.raises(dataclasses.FrozenInstanceError):
        s.op = "c"
    a, b = Bag(), Bag()
    a.items.append(1)
    assert b.items == [] and Bag(items=[2]).items == [2]
    assert isinstance(ms.Undefined_name_is_a_stub, type)  # the rest stays a stub module


def test_runner_orjson_shim_round_trips_json():
    """sglang/srt/utils/common.py imports orjson at the top (not installed on the GPU host):
    the shim's loads and dumps are the json module's, dumps returning bytes as orjson's."""
    t = _runner()
    oj = t._orjson_shim("orjson")
    assert oj.dumps({"b": 1, "a": [1, 2.5]}, option=oj.OPT_SORT_KEYS) == b'{"a": [1, 2.5], "b": 1}'
    assert oj.loads(b'{"x": [1, null]}') == {"x": [1, None]} and oj.loads('"s"') == "s"
    assert oj.dumps("t", default=str, option=oj.OPT_INDENT_2 | oj.OPT_SORT_KEYS) == b'"t"'
    with _harness.raises(oj.JSONDecodeError):
        oj.loads(b"{")
    assert isinstance(oj.Fragment, type)  # the rest stays a stub module


def test_runner_dill_shim_pickles_a_class_by_name():
    """sglang/srt/sampling/custom_logit_processor.py serialises a class with dill at import
    time and json-encodes the hex; with the shim (dill not installed on the GPU host) that is
    pickle, and the class comes back."""
    import json
    import pickle

    t = _runner()
    dl = t._dill_shim("dill")
    text = json.dumps({"callable": dl.dumps(pickle.PickleError).hex()})
    assert dl.loads(bytes.fromhex(json.loads(text)["callable"])) is pickle.PickleError
    assert isinstance(dl.Pickler_is_a_stub, type)  # the rest stays a stub module


def test_runner_finds_its_stub_finder_behind_another():
    """An import after the stubs are installed may append its own finder to sys.meta_path;
    the probe must still extend the runner's finder (it stopped at the first missing module)."""
    t = _runner()
    assert t._stub_finder() is None
    ours, theirs = t._StubFinder(["stepq_x_%d" % os.getpid()]), importlib.machinery.PathFinder
    sys.meta_path.append(ours)
    sys.meta_path.append(theirs)
    try:
        assert t._stub_finder() is ours
    finally:
        sys.meta_path.remove(theirs)
        sys.meta_path.remove(ours)


def test_runner_tolerates_a_second_transformers_registration():
    """transformers newer than the snapshot already knows some names SGLang registers at import
    ("'qwen3_asr' is already used by a Transformers config"): the runner lets SGLang's
    registration replace it and records it."""
    class Mapping:
        def __init__(self):
            self.d = {}

        def register(self, key, value, exist_ok=False):
            if key in self.d and not exist_ok:
                raise ValueError("'%s' is already used by a Transformers config" % key)
            self.d[key] = value

    saved = {k: sys.modules.get(k) for k in ("transformers", "transformers.models",
                                             "transformers.models.auto",
                                             "transformers.models.auto.auto_factory",
                                             "transformers.models.auto.configuration_auto")}
    cfg = types.ModuleType("transformers.models.auto.configuration_auto")
    fac = types.ModuleType("transformers.models.auto.auto_factory")
    cfg._LazyConfigMapping = type("_LazyConfigMapping", (Mapping,), {})
    fac._LazyAutoMapping = type("_LazyAutoMapping", (Mapping,), {})
    auto = types.ModuleType("transformers.models.auto")
    auto.configuration_auto, auto.auto_factory = cfg, fac
    sys.modules.update({"transformers": types.ModuleType("transformers"),
                        "transformers.models": types.ModuleType("transformers.models"),
                        "transformers.models.auto": auto,
                        "transformers.models.auto.auto_factory": fac,
                        "transformers.models.auto.configuration_auto": cfg})
    try:
        t = _runner()
        t._tolerate_reregistration()
        t._tolerate_reregistration()  # idempotent: wrapped once
        m = cfg._LazyConfigMapping()
        m.register("qwen3_asr", "transformers' own")
        m.register("qwen3_asr", "SGLang's")
        assert m.d["qwen3_asr"] == "SGLang's"
        assert [n for n, _ in t._Stubs.reregistered] == ["qwen3_asr"], t._Stubs.reregistered
        p = fac._LazyAutoMapping()
        p.register("cfg", 1)
        p.register("cfg", 2, exist_ok=True)  # an explicit exist_ok is passed through, not recorded
        assert p.d["cfg"] == 2 and len(t._Stubs.reregistered) == 1
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_runner_uniform_maps_load_and_match_their_shapes():
    t = _runner()
    shapes = [  # test_unified_radix_cache_unittest's default mamba shape, and a KDA one
        dict(is_kda=False, layer_ids=[0, 1, 2, 4, 5, 6], temporal=(2, 16, 16), conv=[(288, 3)],
             conv_dtype="bf16", temporal_dtype="bf16", num_k_heads_per_tp=1),
        dict(is_kda=True, layer_ids=[0, 2], temporal=(4, 32, 32), conv=[(3, 384)],
             conv_dtype="bf16", temporal_dtype="fp32", num_k_heads_per_tp=4)]
    import json

    for cd in shapes:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(t._uniform_map(cd), f)
        try:
            m = stepq.load_map(f.name)
            assert plugin.check_map(plugin.map_desc(m), cd) == 1
            assert m.method == "uniform" and m.budget_bits == 8
        finally:
            os.unlink(f.name)


def test_runner_static_walk_of_the_snapshot():
    snap = _snapshot()
    r = subprocess.run([sys.executable, RUNNER, "--sglang", snap, "--static"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True)
    assert r.returncode == 0 and "module_level:" in r.stdout and "torch" in r.stdout, r.stdout


def test_snapshot_script():
    r = subprocess.run(["sh", SNAPSHOT_SH], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       universal_newlines=True)
    assert r.returncode == 2 and "usage" in r.stdout, r.stdout
    if not os.path.isdir(MIRROR) or not shutil_which("git"):
        _harness.skip("no SGLang mirror at %s" % MIRROR)
    with tempfile.TemporaryDirectory() as d:
        dest = os.path.join(d, "sglang")
        r = subprocess.run(["sh", SNAPSHOT_SH, dest], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        assert r.returncode == 0, r.stdout
        info = dict(l.split(": ", 1) for l in open(os.path.join(dest, "SNAPSHOT")).read().splitlines())
        assert info["commit"].startswith("8905cbd42f4a") and int(info["bytes"]) < 40 << 20, info
        assert os.path.isfile(os.path.join(dest, "python", "sglang", "srt", "plugins",
                                           "hook_registry.py"))
        assert not os.path.exists(os.path.join(dest, "python", "sglang", "multimodal_gen"))
        r = subprocess.run(["sh", SNAPSHOT_SH, dest], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        assert r.returncode == 0, r.stdout   # a snapshot is replaced
        os.remove(os.path.join(dest, "SNAPSHOT"))
        r = subprocess.run(["sh", SNAPSHOT_SH, dest], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        assert r.returncode == 1 and "not overwriting" in r.stdout, r.stdout


def shutil_which(name):
    import shutil

    return shutil.which(name)


if __name__ == "__main__":
    sys.exit(_harness.main(dict(globals())))


def test_runner_unwraps_sglangs_retry_and_names_tests_by_class():
    """SGLang's CustomTestCase re-raises every test error as Exception("retry() exceed maximum
    number of retries."): the report gives the test's own error (its __context__). Its unified
    radix tests repeat method names over one generated class per configuration, and a failing
    subtest reports no success: rows are module.Class.method, one per failing subtest."""
    import unittest

    t = _runner()

    def wrapped():
        try:
            raise ValueError("STEPQ_ENOTSUP: the real cause")
        except Exception:
            raise Exception("retry() exceed maximum number of retries.")

    try:
        wrapped()
    except Exception:
        got = t._exc_summary(sys.exc_info())
    assert got["type"] == "ValueError" and "real cause" in got["message"], got
    assert got.get("via") == "SGLang's retry() wrapper" and "wrapped" in got["where"][-1], got
    try:
        raise Exception("retry() exceed maximum number of retries.")
    except Exception:
        bare = t._exc_summary(sys.exc_info())
    assert bare["type"] == "Exception" and "via" not in bare, bare

    class CfgA(unittest.TestCase):
        def test_same(self):
            pass

    class CfgB(unittest.TestCase):
        def test_same(self):
            for case in (1, 2):
                with self.subTest(case=case):
                    self.assertEqual(case, 1)

    result = t._result_class()()
    loader = unittest.TestLoader()
    unittest.TestSuite([loader.loadTestsFromTestCase(c) for c in (CfgA, CfgB)]).run(result)
    rows = [(r["test"].split(".", 1)[1], r["outcome"]) for r in result.rows]
    assert rows == [("CfgA.test_same", "passed"), ("CfgB.test_same (case=2)", "failed")], rows


def test_runner_compares_runs_test_for_test():
    """The verdicts: same; a stepq refusal where the baseline passed, also for a failing subtest
    whose test passed whole in the baseline, and where the baseline errored on something else
    (a stubbed kernel); a stepq-only failure; a missing baseline run compares nothing."""
    t = _runner()
    ref = "STEPQ_ENOTSUP: stepq (STEPQ_MAP) does not serve speculative decoding"
    base = {"tests": [{"test": "m.A.t1", "outcome": "passed"},
                      {"test": "m.A.t2", "outcome": "passed"},
                      {"test": "m.A.t3", "outcome": "errored", "message": "sgl_kernel.x called: it is a stub"},
                      {"test": "m.A.t4", "outcome": "passed"},
                      {"test": "m.A.t5", "outcome": "skipped", "message": "requires SWA"}]}
    mine = {"tests": [{"test": "m.A.t1", "outcome": "passed"},
                      {"test": "m.A.t2 (case='x')", "outcome": "errored", "message": ref},
                      {"test": "m.A.t3", "outcome": "errored", "message": ref},
                      {"test": "m.A.t4", "outcome": "failed", "message": "AssertionError: 1 != 2"},
                      {"test": "m.A.t5", "outcome": "skipped", "message": "requires SWA"}]}
    got = t.compare_runs({"baseline": base, "stepq": mine})
    assert list(got) == ["stepq vs baseline"], got
    assert [r["verdict"] for r in got["stepq vs baseline"]] == [
        "same", "stepq refusal", "stepq refusal (baseline errored too, on another cause)",
        "stepq-only failure", "same"], got
    assert got["stepq vs baseline"][1]["baseline"] == "passed"
    assert t.compare_runs({"stepq": mine}) == {}


def test_runner_summarize_a_report():
    """--summarize: counts, errors grouped by cause (stepq's refusals by what they refuse, stubbed
    modules by name), the verdicts and the rows that differ, from a report alone; a file that is
    not a report is refused by name."""
    ref = ("STEPQ_ENOTSUP: stepq (STEPQ_MAP) does not serve speculative decoding "
           "(speculative_num_draft_tokens=3): its verify step")
    stub = "sgl_kernel.kvcacheio.transfer called: it is a stub (sglang_tests.py), the module is not installed"
    report = {"runs": {
        "baseline": {"tests": [{"test": "m.A.t1", "outcome": "passed"},
                               {"test": "m.A.t2", "outcome": "errored", "type": "RuntimeError", "message": stub}]},
        "stepq": {"tests": [{"test": "m.A.t1", "outcome": "errored", "type": "Unsupported", "message": ref},
                            {"test": "m.A.t2", "outcome": "errored", "type": "RuntimeError", "message": stub}]}},
        "kernel_check": {"checks": [{"check": "gdn: decode", "outcome": "passed", "detail": {"out_rel": 0.0}}]}}
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "r.json"), os.path.join(d, "s.json")
        with open(src, "w") as f:
            json.dump(report, f)
        r = subprocess.run([sys.executable, RUNNER, "--summarize", src, "--json", dst], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        assert r.returncode == 0, r.stdout
        got = json.load(open(dst))
        assert got["runs"]["stepq"]["errors_by_cause"] == {
            "errored: stepq refusal: speculative decoding": 1,
            "errored: stubbed module called: sgl_kernel.kvcacheio.transfer": 1}, got
        c = got["comparison"]["stepq vs baseline"]
        assert c["verdicts"] == {"stepq refusal": 1, "same": 1} and len(c["not_same"]) == 1, c
        assert got["kernel_check"][0]["outcome"] == "passed" and "kernel check: passed" in r.stdout
        with open(src, "w") as f:
            f.write("{}")
        r = subprocess.run([sys.executable, RUNNER, "--summarize", src], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        assert r.returncode != 0 and "no runs" in r.stdout, r.stdout
