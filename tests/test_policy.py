"""Policy YAML: parsing, validation messages, rule precedence, loading, strictness."""

import logging
import textwrap
from pathlib import Path

import pytest

from qattn_compile.errors import PolicyError
from qattn_compile.policy import (
    DEFAULT_POLICY_PATH,
    DICT_SOURCE,
    TEXT_SOURCE,
    Decision,
    Policy,
    Rule,
    load_policy,
    match_pattern,
)
from qattn_compile.presets import (
    PRESET_NAMES,
    FlashOptions,
    FmhaInt8Options,
    IntFlashOptions,
    NoOptions,
    Sage2Options,
    TurboOptions,
)

REPO = Path(__file__).resolve().parents[1]

FULL = """\
qattn: 1
default: int_flash
default_options: {v_granularity: tensor}
ignore: ["*vision_tower*", "re:.*\\\\.cross_attn"]
on_unsupported: error
strict: true
rules:
  - match: "*self_attn"
    preset: sage2_8b
    options: {qk_granularity: block}
  - match: "re:model\\\\.layers\\\\.(0|31)\\\\.self_attn"
    preset: fmha_int8
    options: {scales: static, calibration: scales.json}
  - module_class: BertSelfAttention
    preset: flash
  - match: "enc.*"
    module_class: "*Attention"
    preset: turbo
"""


def policy(text: str) -> Policy:
    return load_policy(textwrap.dedent(text))


def error_of(source) -> str:
    with pytest.raises(PolicyError) as info:
        load_policy(source)
    exc = info.value
    assert exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__
    assert "\n" not in str(exc) and "pydantic" not in str(exc)
    return str(exc)


# ----------------------------------------------------------------------------- parsing


def test_every_field_is_parsed():
    p = load_policy(FULL)
    assert p.qattn == 1
    assert p.default == "int_flash"
    assert p.default_options == IntFlashOptions(v_granularity="tensor")
    assert p.ignore == ("*vision_tower*", "re:.*\\.cross_attn")
    assert p.on_unsupported == "error"
    assert p.strict is True
    assert len(p.rules) == 4
    r0, r1, r2, r3 = p.rules
    assert (r0.match, r0.module_class, r0.preset) == ("*self_attn", None, "sage2_8b")
    assert r0.options == Sage2Options(qk_granularity="block")
    assert r0.options.smooth_k is True  # defaults filled
    assert r1.match == "re:model\\.layers\\.(0|31)\\.self_attn"
    assert r1.options == FmhaInt8Options(scales="static", calibration="scales.json")
    assert (r2.match, r2.module_class, r2.preset, r2.options) == (
        None, "BertSelfAttention", "flash", FlashOptions())
    assert (r3.match, r3.module_class, r3.preset) == ("enc.*", "*Attention", "turbo")
    assert r3.options == TurboOptions()


def test_defaults_of_a_minimal_policy():
    p = policy("qattn: 1")
    assert p.default == "none"
    assert p.default_options == NoOptions()
    assert p.ignore == ()
    assert p.on_unsupported == "fallback"
    assert p.strict is False
    assert p.rules == ()
    d = p.decide("model.layers.0.self_attn", "LlamaAttention")
    assert (d.preset, d.rule_index, d.rule_text) == ("none", None, "default")
    assert "no rule matches 'model.layers.0.self_attn'" in d.reason
    assert "left alone" in d.reason


def test_empty_lists_may_be_left_blank():
    p = policy("""
        qattn: 1
        ignore:
        rules:
        default: sage2_4b
        default_options:
    """)
    assert p.rules == () and p.ignore == ()
    assert p.default_options == Sage2Options()


def test_policy_is_immutable():
    p = load_policy(FULL)
    with pytest.raises(Exception):
        p.default = "flash"
    with pytest.raises(Exception):
        p.rules[0].preset = "flash"
    assert hash(p) == hash(load_policy(FULL))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("qattn: 2", ["<policy text>", "field `qattn`", "unsupported schema version 2",
                      "`qattn: 1`"]),
        ("qattn: true", ["field `qattn`", "unsupported schema version True"]),
        ("default: flash\nrules: []", ["missing required key `qattn`", "write `qattn: 1`"]),
        ("- qattn: 1\n- x", ["top level must be a mapping", "got a list"]),
        ("qattn: 1\nrules: {match: a, preset: flash}", ["field `rules`", "must be a list",
                                                        "got a mapping"]),
        ("qattn: 1\nrules: [sage2_8b]", ["rules[0]", "must be a mapping", "got a string 'sage2_8b'",
                                         "allowed keys: match, module_class, preset, options"]),
        ("qattn: 1\non_unsupported: skip", ["field `on_unsupported`", "'skip'",
                                            "allowed: 'fallback' or 'error'"]),
        ("qattn: 1\nstrict: maybe", ["field `strict`", "must be true or false", "'maybe'"]),
        ("qattn: 1\ndefault: sage3", ["field `default`", "unknown preset 'sage3'",
                                      "choose one of: " + ", ".join(PRESET_NAMES)]),
        ("qattn: 1\ndefualt: flash", ["unknown key `defualt`", "did you mean `default`?",
                                      "allowed keys: qattn, default, default_options, ignore, "
                                      "on_unsupported, strict, rules"]),
        ("qattn: 1\ndefault: flash\ndefault_options: {x: 1}",
         ["field `default_options`", "bad options for preset 'flash'", "unknown key `x`; allowed keys: autotune"]),
        ("qattn: 1\ndefault: none\ndefault_options: {x: 1}",
         ["bad options for preset 'none'", "unknown key `x`; no keys are allowed here"]),
        ("qattn: 1\ndefault: flash\ndefault_options: [x]",
         ["field `default_options`", "must be a mapping", "options of preset 'flash': autotune"]),
        ("qattn: 1\ndefault:", ["field `default`", "is empty; choose one of: none"]),
        ("qattn: 1\nignore: ['re:(']", ["field `ignore`", "ignore[0]", "bad regular expression"]),
        ("qattn: 1\nignore: [a, 3]", ["ignore[1]", "must be a string", "got a number 3"]),
    ],
)
def test_top_level_errors(text, fragments):
    message = error_of(text)
    assert message.startswith("policy <policy text>: ")
    for fragment in fragments:
        assert fragment in message, (fragment, message)


RULES = """\
qattn: 1
rules:
  - match: "*mlp"
    preset: flash
  - match: "*attn"
    preset: flash
  - {rule}
"""


@pytest.mark.parametrize(
    "rule, fragments",
    [
        ("{match: '*self_attn', preset: sage3}",
         ["rules[2] (match '*self_attn')", "field `preset`", "unknown preset 'sage3'",
          "choose one of: " + ", ".join(PRESET_NAMES)]),
        ("{match: '*self_attn'}",
         ["rules[2] (match '*self_attn')", "missing required key `preset`", "choose one of: none"]),
        ("{match: '*self_attn', preset: flash, optoins: {}}",
         ["rules[2] (match '*self_attn')", "unknown key `optoins`", "did you mean `options`?",
          "allowed keys: match, module_class, preset, options"]),
        ("{preset: flash}",
         ["rules[2] (no match or module_class)", "`match:`", "`module_class:`"]),
        ("{module_class: BertSelfAttention, preset: int_flash, options: {v_granularity: row}}",
         ["rules[2] (module_class 'BertSelfAttention')", "field `options`",
          "bad options for preset 'int_flash'", "v_granularity", "got a string 'row'",
          "'tensor' or 'block'"]),
        ("{match: x, preset: sage2_8b, options: {qk_granularty: warp}}",
         ["bad options for preset 'sage2_8b'", "unknown key `qk_granularty`",
          "did you mean `qk_granularity`?"]),
        ("{match: x, preset: sage2_8b, options: {smooth_k: 0}}",
         ["bad options for preset 'sage2_8b'", "field `smooth_k`", "must be true or false",
          "got a number 0"]),
        ("{match: x, preset: turbo, options: {sas_threshold: '-6'}}",
         ["bad options for preset 'turbo'", "field `sas_threshold`", "must be a number",
          "got a string '-6'"]),
        ("{match: 're:layers\\.(', preset: flash}",
         ["rules[2] (match 're:layers\\.(')", "field `match`", "bad regular expression",
          "missing )"]),
        ("{match: 'a', module_class: 're:[', preset: flash}",
         ["rules[2] (match 'a', module_class 're:[')", "field `module_class`",
          "bad regular expression"]),
        ("{match: 7, preset: flash}", ["rules[2] (match 7)", "field `match`", "must be a string"]),
        ("{match: 'model.layers.[0-3.self_attn', preset: flash}",
         ["rules[2] (match 'model.layers.[0-3.self_attn')", "field `match`", "unclosed `[` at position 13 of glob"]),
        ("{match: 'x', preset: sage2_8b, options: [block]}",
         ["rules[2] (match 'x')", "field `options`", "must be a mapping", "qk_granularity"]),
    ],
)
def test_rule_errors_name_rule_match_field_and_allowed(rule, fragments):
    message = error_of(RULES.format(rule=rule))
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "rules[0]" not in message and "rules[1]" not in message


@pytest.mark.parametrize("glob", ["layers.[0-3].attn", "x[]]", "[!a]*", "[a[]", "*[[]*", "mod[[]0]"])
def test_globs_with_sets_are_accepted(glob):
    """fnmatch's sets, ``]`` first or ``[`` inside included; ``[[]`` matches a literal ``[``."""
    assert load_policy(RULES.format(rule=f"{{match: '{glob}', preset: flash}}")).rules[2].match == glob


@pytest.mark.parametrize("glob, position", [("layers.[0-3.attn", 7), ("a[0]b[", 5), ("x[!]", 1)])
def test_a_glob_with_an_unclosed_bracket_is_refused(glob, position):
    message = error_of(RULES.format(rule=f"{{match: '{glob}', preset: flash}}"))
    assert f"field `match`: unclosed `[` at position {position} of glob {glob!r}" in message, message


def test_a_bad_option_is_one_sentence():
    """A wrong value says what is allowed for that field, an unknown key which keys are; the
    ~1,000 characters describing every option no longer follow either."""
    bad_value = error_of(RULES.format(rule="{match: x, preset: int_flash, options: {p_scale: rows}}"))
    assert bad_value.endswith("field `p_scale`: got a string 'rows'; allowed: 'tile' or 'row'")
    unknown = error_of(RULES.format(rule="{match: x, preset: int_flash, options: {p_scal: row}}"))
    assert unknown.endswith("unknown key `p_scal` (did you mean `p_scale`?); allowed keys: autotune, "
                            "v_granularity, k_granularity, smooth_k, p_scale"), unknown


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(RULES.format(rule="{match: '*self_attn', preset: sage3}"))
    message = error_of(path)
    assert message.startswith(f"policy {path}: rules[2] (match '*self_attn'): field `preset`")
    assert error_of(str(path)) == message


def test_fmha_int8_static_without_calibration_is_an_error():
    message = error_of(RULES.format(rule="{match: '*self_attn', preset: fmha_int8, "
                                         "options: {scales: static}}"))
    assert "rules[2] (match '*self_attn')" in message
    assert "field `options`" in message
    assert "calibration" in message
    ok = load_policy(RULES.format(rule="{match: '*self_attn', preset: fmha_int8, "
                                       "options: {scales: static, calibration: s.json}}"))
    assert ok.rules[2].options.calibration == "s.json"


def test_sage2_unknown_option_lists_allowed_keys():
    message = error_of(RULES.format(rule="{match: '*self_attn', preset: sage2_8b, "
                                         "options: {smooth_x: true}}"))
    assert "smooth_x" in message
    for key in ("qk_granularity", "smooth_k", "smooth_q", "smooth_v", "pv"):
        assert key in message


def test_sage2_pv_option():
    ok = load_policy(RULES.format(rule="{match: '*self_attn', preset: sage2_8b, "
                                       "options: {pv: fp16}}"))
    assert ok.rules[2].options == Sage2Options(pv="fp16")
    assert ok.to_dict()["rules"][2]["options"] == {"pv": "fp16"}
    message = error_of(RULES.format(rule="{match: '*self_attn', preset: sage2_8b, "
                                         "options: {pv: fp4}}"))
    for fragment in ("rules[2] (match '*self_attn')", "bad options for preset 'sage2_8b'",
                     "field `pv`", "'fp8' or 'fp16'"):
        assert fragment in message, (fragment, message)
    message = error_of(RULES.format(rule="{match: x, preset: sage2_4b, "
                                         "options: {pv: fp16, smooth_v: true}}"))
    assert "`smooth_v: true`" in message and "`pv: fp16`" in message


def test_int_flash_smooth_k_option():
    p = load_policy(RULES.format(rule="{match: x, preset: int_flash, options: {smooth_k: false}}"))
    assert p.rules[2].options == IntFlashOptions(smooth_k=False)
    assert IntFlashOptions().smooth_k is True  # default: smoothed K (exact math)
    assert "field `smooth_k`" in error_of(
        RULES.format(rule="{match: x, preset: int_flash, options: {smooth_k: maybe}}"))


def test_options_are_validated_against_their_own_preset():
    # a valid sage2 option is not valid for turbo, and vice versa
    assert "unknown key `qk_granularity`" in error_of(
        RULES.format(rule="{match: x, preset: turbo, options: {qk_granularity: block}}"))
    assert "unknown key `sas_threshold`" in error_of(
        RULES.format(rule="{match: x, preset: sage2_8b, options: {sas_threshold: -1.0}}"))
    # and each preset's own constraints: turbo's threshold must be negative
    assert "field `sas_threshold`: Input should be less than 0" in error_of(
        RULES.format(rule="{match: x, preset: turbo, options: {sas_threshold: 1.0}}"))
    assert "field `sas_threshold`: Input should be greater than or equal to -80" in error_of(
        RULES.format(rule="{match: x, preset: turbo, options: {sas_threshold: -100.0}}"))
    p = load_policy(RULES.format(rule="{match: x, preset: sage2_4b, options: {smooth_v: true}}"))
    assert p.rules[2].options == Sage2Options(smooth_v=True)


def test_several_problems_are_reported_in_one_paragraph():
    message = error_of("qattn: 1\non_unsupported: x\nrules: [{match: a, preset: nope}]")
    assert "field `on_unsupported`" in message
    assert "rules[0] (match 'a'): field `preset`" in message


@pytest.mark.parametrize(
    "text, line, column, problem",
    [
        ("qattn: 1\nrules:\n  - match: [a\n", 4, 1, "expected ',' or ']'"),
        # PyYAML's Python parser ends with "here", libyaml's with "in this context"
        ("qattn: 1\n  default: flash\n", 2, 10, "mapping values are not allowed"),
        ("qattn: 1\nrules:\n  - match: a\n    match: b\n    preset: flash\n", 4, 5,
         "duplicate key 'match'"),
    ],
)
def test_bad_yaml_reports_line_and_column(text, line, column, problem):
    message = error_of(text)
    assert message.startswith(f"policy <policy text>: bad YAML at line {line}, column {column}: ")
    assert problem in message


def test_empty_policy_text():
    assert "the policy is empty" in error_of("# nothing here\n")


def test_unloadable_source_type():
    assert "cannot load a policy from a number 3" in error_of(3)


# ----------------------------------------------------------------------------- hostile policies
# Each is refused with a PolicyError naming the file, a message of bounded length, in time
# bounded by the size of the text (not of what it stands for).


def _shared_bomb(levels: int = 9, width: int = 9) -> list:
    """A list standing for width**levels strings, built from shared references in
    O(levels * width) memory, as YAML aliases build it."""
    value: list = ["lol"] * width
    for _ in range(levels - 1):
        value = [value] * width
    return value


def _error_of_file(tmp_path, text: str) -> str:
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(f"policy {path}: bad YAML at line "), message
    return message


@pytest.mark.parametrize("nested", [
    "rules: " + "[" * 500 + "]" * 500,
    "default_options: " + "{a: " * 500 + "1" + "}" * 500,
    "rules:\n" + "".join("  " * i + "-\n" for i in range(1, 500)),
], ids=["flow sequences", "flow mappings", "block sequences"])
def test_a_policy_nested_500_deep_is_refused_not_a_recursion_error(tmp_path, nested):
    message = _error_of_file(tmp_path, "qattn: 1\n" + nested + "\n")
    assert "nested more than 32 levels deep" in message
    assert len(message) < 300


def test_qattn_explain_blames_a_deeply_nested_policy_not_the_model(tmp_path, capsys):
    """A RecursionError from the policy was reported as the MODEL_SPEC failing."""
    from qattn_compile.cli import main

    path = tmp_path / "deep.yaml"
    path.write_text("qattn: 1\nrules: " + "[" * 500 + "]" * 500 + "\n")
    assert main(["explain", "tiny-llama", "--policy", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qattn: error: policy {path}: bad YAML at line 2, column ")
    assert "nested more than 32 levels deep" in err and "MODEL_SPEC" not in err


def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    """471 bytes standing for 9**9 strings: nothing walks them (PyYAML builds them as shared
    objects; a validator or an error message walking every copy took 40 s and 460 MiB)."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    text = "qattn: 1\nanchors:\n" + "".join(f"  {line}\n" for line in lines) + "default: *i\n"
    assert len(text) < 500
    message = _error_of_file(tmp_path, text)
    assert "aliases expand to more than 500000 values (an alias bomb?)" in message
    assert len(message) < 300


def test_an_integer_too_long_to_convert_is_a_yaml_error(tmp_path):
    message = _error_of_file(tmp_path, "qattn: 1\nstrict: " + "9" * 5000 + "\n")
    assert message.endswith("at line 2, column 9: an integer of more than 4300 digits")


def test_aliases_that_stay_small_are_read():
    p = policy("""
        qattn: 1
        rules:
          - {match: "*q_attn", preset: int_flash, options: &opts {k_granularity: token}}
          - {match: "*k_attn", preset: int_flash, options: *opts}
    """)
    assert p.rules[0].options == p.rules[1].options == IntFlashOptions(k_granularity="token")


@pytest.mark.parametrize("field, wrong", [
    ("default", None), ("qattn", None), ("strict", None), ("ignore", None), ("rules", None),
    ("rules", "match"), ("rules", "options"), ("kv_cache", None), ("kv_cache", "rules"),
], ids=lambda x: str(x))
def test_a_huge_shared_value_is_shown_in_a_few_characters(field, wrong):
    """A dict built in Python can hold what an alias bomb stands for: every message shows a
    bounded part of it (it showed the repr of all 9**9 strings, then cut it)."""
    bomb = _shared_bomb()
    data = {"qattn": 1, field: bomb}
    if (field, wrong) == ("rules", "match"):
        data["rules"] = [{"match": bomb, "preset": "flash"}]
    elif (field, wrong) == ("rules", "options"):
        data["rules"] = [{"match": "x", "preset": "sage2_8b", "options": {"pv": bomb}}]
    elif (field, wrong) == ("kv_cache", "rules"):
        data["kv_cache"] = {"rules": bomb}
    with pytest.raises(PolicyError) as info:
        Policy.from_dict(data, source="bomb.yaml")
    message = str(info.value)
    assert message.startswith("policy bomb.yaml: ")
    assert "[[[[" in message and len(message) < 1500, message


def test_twenty_thousand_bad_rules_give_the_first_problems_and_a_count():
    rules = [{"match": f"layers.{i}.attn", "preset": "bogus"} for i in range(20_000)]
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"qattn": 1, "rules": rules}, source="many.yaml")
    message = str(info.value)
    assert message.startswith("policy many.yaml: rules[0] (match 'layers.0.attn'): field "
                              "`preset`: unknown preset 'bogus'")
    assert "rules[4] (match 'layers.4.attn')" in message and "rules[5]" not in message
    assert message.endswith("and 19995 more problem(s) (20000 in all)")
    assert len(message) < 1500


def test_a_huge_pattern_or_preset_name_is_cut_in_the_message():
    huge = "x" * 100_000
    for rule in ({"match": "re:(" + huge, "preset": "flash"}, {"match": huge, "preset": huge},
                 {"match": "[" + huge, "preset": "flash"}):
        with pytest.raises(PolicyError) as info:
            Policy.from_dict({"qattn": 1, "rules": [rule]}, source="huge.yaml")
        assert str(info.value).startswith("policy huge.yaml: rules[0] (match '")
        assert len(str(info.value)) < 800


def test_strict_with_many_unmatched_rules_lists_the_first():
    rules = [{"match": f"nothing.{i}", "preset": "flash"} for i in range(100)]
    p = Policy.from_dict({"qattn": 1, "strict": True, "rules": rules})
    with pytest.raises(PolicyError) as info:
        p.check_unmatched(set())
    message = str(info.value)
    assert "100 rule(s) matched no attention site" in message
    assert "rules[4] (`nothing.4`) matched no site" in message and "nothing.5`" not in message
    assert "and 95 more problem(s) (100 in all)" in message


# ----------------------------------------------------------------------------- decisions


def test_last_matching_rule_wins():
    p = load_policy(FULL.replace("strict: true", "strict: false"))
    d = p.decide("model.layers.0.self_attn", "LlamaAttention")
    assert d == Decision(
        preset="fmha_int8",
        options=FmhaInt8Options(scales="static", calibration="scales.json"),
        rule_index=1,
        rule_text="rules[1] (match 're:model\\.layers\\.(0|31)\\.self_attn')",
        reason="rules[1] (match 're:model\\.layers\\.(0|31)\\.self_attn') is the last rule "
        "matching 'model.layers.0.self_attn' (it overrides rules[0]): preset fmha_int8",
        matched_rules=(0, 1),
    )
    d = p.decide("model.layers.5.self_attn", "LlamaAttention")
    assert (d.preset, d.rule_index, d.rule_text) == ("sage2_8b", 0, "rules[0] (match '*self_attn')")
    assert d.options.qk_granularity == "block"


def test_order_decides_not_specificity():
    p = policy("""
        qattn: 1
        rules:
          - {match: "model.layers.0.self_attn", preset: int_flash}
          - {match: "*", preset: flash}
    """)
    assert p.decide("model.layers.0.self_attn").rule_index == 1
    assert p.decide("model.layers.0.self_attn").preset == "flash"


def test_ignore_always_wins():
    p = load_policy(FULL)
    for fqn, matched in (("model.vision_tower.layers.0.self_attn", (0, 2)),
                         ("decoder.block.3.cross_attn", (2,))):
        d = p.decide(fqn, "BertSelfAttention")
        assert (d.preset, d.rule_index, d.options) == ("none", None, NoOptions())
        assert d.matched_rules == matched  # the rules match (strict counts them); ignore wins
        assert d.rule_text.startswith("ignore '")
        assert "always wins" in d.reason
    assert p.decide("decoder.block.3.cross_attn", None).rule_text == "ignore 're:.*\\.cross_attn'"


def test_default_when_nothing_matches():
    p = load_policy(FULL)
    d = p.decide("decoder.mlp", "LlamaMLP")
    assert (d.preset, d.options, d.rule_index, d.rule_text) == (
        "int_flash", IntFlashOptions(v_granularity="tensor"), None, "default")
    assert d.reason == ("no rule matches 'decoder.mlp' (class LlamaMLP); "
                        "the default applies: preset int_flash")


def test_module_class_rules():
    p = load_policy(FULL)
    d = p.decide("bert.encoder.layer.0.attention.self", "BertSelfAttention")
    assert (d.preset, d.rule_index) == ("flash", 2)
    assert d.rule_text == "rules[2] (module_class 'BertSelfAttention')"
    # exact name: no prefix / suffix matches; unknown class never matches a class rule
    assert p.decide("bert.encoder.layer.0.attention.self", "BertSelfAttention2").rule_index is None
    assert p.decide("bert.encoder.layer.0.attention.self", None).rule_index is None


def test_match_and_module_class_together_need_both():
    p = load_policy(FULL)
    assert p.decide("enc.layer.0", "T5Attention").rule_index == 3
    assert p.decide("enc.layer.0", "T5LayerNorm").rule_index is None
    assert p.decide("dec.layer.0", "T5Attention").rule_index is None
    assert p.decide("enc.layer.0", "T5Attention").rule_text == (
        "rules[3] (match 'enc.*', module_class '*Attention')")


def test_rule_with_preset_none_leaves_alone_but_counts_as_matched():
    p = policy("""
        qattn: 1
        default: sage2_8b
        rules: [{match: "*.0.*", preset: none}]
    """)
    d = p.decide("layers.0.attn")
    assert (d.preset, d.rule_index) == ("none", 0)
    assert d.reason.endswith("left alone")


def test_glob_versus_regex_fullmatch():
    assert match_pattern("*layers.1*", "model.layers.10.self_attn")
    assert match_pattern("model.layers.?.self_attn", "model.layers.3.self_attn")
    assert not match_pattern("model.layers.?.self_attn", "model.layers.13.self_attn")
    assert not match_pattern("*Self_Attn", "x.self_attn")  # case-sensitive
    # re: is a fullmatch, not a search
    assert not match_pattern("re:layers\\.1", "model.layers.10.self_attn")
    assert not match_pattern("re:layers\\.1", "layers.10")
    assert match_pattern("re:layers\\.1", "layers.1")
    assert match_pattern("re:.*layers\\.1\\..*", "model.layers.1.self_attn")
    assert not match_pattern("re:.*layers\\.1\\..*", "model.layers.10.self_attn")
    # a "re:"-less pattern with regex characters is a glob: '.' is literal, '[0-3]' a class
    assert not match_pattern("layers.(0|1)", "layers.0")
    assert match_pattern("layers.[0-3]", "layers.2")
    assert not match_pattern("layers.[0-3]", "layersX2")


def test_decision_is_frozen():
    d = load_policy(FULL).decide("x")
    with pytest.raises(Exception):
        d.preset = "flash"


# ----------------------------------------------------------------------------- loading


def test_load_from_path_str_text_dict_and_policy(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(FULL)
    from_path = load_policy(path)
    from_str = load_policy(str(path))
    from_text = load_policy(FULL)
    from_dict = load_policy(from_text.to_dict())
    assert from_path.source == str(path)
    assert from_str.source == str(path)
    assert from_text.source == TEXT_SOURCE
    assert from_dict.source == DICT_SOURCE
    assert from_path.to_dict() == from_str.to_dict() == from_text.to_dict() == from_dict.to_dict()
    assert load_policy(from_text) is from_text


def test_one_line_text_with_a_colon_is_yaml():
    p = load_policy("{qattn: 1, default: flash}")
    assert (p.default, p.source) == ("flash", TEXT_SOURCE)


@pytest.mark.parametrize("name", ["missing.yaml", "conf/missing.yml", "missing_policy"])
def test_missing_file(tmp_path, name):
    assert error_of(name) == f"policy file not found: {name}"
    assert error_of(tmp_path / name) == f"policy file not found: {tmp_path / name}"
    (tmp_path / "conf.yaml").mkdir()
    assert error_of(str(tmp_path / "conf.yaml")) == (
        f"policy path {tmp_path / 'conf.yaml'} is a directory, not a policy file")


def test_from_dict_rejects_a_non_mapping():
    with pytest.raises(PolicyError, match="top level must be a mapping"):
        Policy.from_dict(["qattn", 1])


def test_from_dict_names_its_source():
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"qattn": 1, "rules": [{"match": "a", "preset": "x"}]}, source="cfg.py")
    assert str(info.value).startswith("policy cfg.py: rules[0] (match 'a'): field `preset`")


def test_constructor_checks_as_from_dict_does():
    with pytest.raises(PolicyError) as info:
        Policy(qattn=1, rules=[{"match": "a", "preset": "x"}])
    assert str(info.value).startswith("policy <policy dict>: rules[0] (match 'a'): field `preset`")
    with pytest.raises(PolicyError, match="unsupported schema version 2"):
        Policy(qattn=2)
    assert Policy(qattn=1, default="int_flash").decide("layers.0.attn").preset == "int_flash"


def test_from_dict_names_a_key_that_is_not_a_string():
    with pytest.raises(PolicyError) as info:
        Policy.from_dict({"qattn": 1, 1: "x"}, source="cfg.yaml")
    assert str(info.value).startswith("policy cfg.yaml: key 1 is not a string; allowed keys: qattn,")


def test_from_dict_names_an_unknown_key_called_self():
    with pytest.raises(PolicyError, match="policy cfg.yaml: unknown key `self`; allowed keys"):
        Policy.from_dict({"qattn": 1, "self": 2}, source="cfg.yaml")


# ----------------------------------------------------------------------------- strictness


def test_unmatched_rules_descriptions():
    p = load_policy(FULL)
    assert p.unmatched_rules({0, 1, 2, 3}) == []
    assert p.unmatched_rules({0, 2}) == [
        "rules[1] (`re:model\\.layers\\.(0|31)\\.self_attn`) matched no site",
        "rules[3] (`enc.*`, class `*Attention`) matched no site",
    ]


def test_check_unmatched_warns_when_not_strict(caplog):
    p = policy("""
        qattn: 1
        rules:
          - {match: "*self_atn", preset: flash}
          - {match: "*self_attn", preset: flash}
    """)
    matched = {d.rule_index for d in (p.decide("l.0.self_attn"), p.decide("l.1.self_attn"))}
    assert matched == {1}
    with caplog.at_level(logging.WARNING, logger="qattn_compile.policy"):
        assert p.check_unmatched(matched) == ["rules[0] (`*self_atn`) matched no site"]
    assert [r.getMessage() for r in caplog.records] == [
        "policy <policy text>: rules[0] (`*self_atn`) matched no site"]
    assert caplog.records[0].name == "qattn_compile.policy"


def test_check_unmatched_raises_when_strict(caplog):
    p = policy("""
        qattn: 1
        strict: true
        rules:
          - {match: "*self_atn", preset: flash}
          - {module_class: "Bert", preset: flash}
          - {match: "*self_attn", preset: flash}
    """)
    assert p.check_unmatched({0, 1, 2}) == []
    with pytest.raises(PolicyError) as info:
        p.check_unmatched({2})
    message = str(info.value)
    assert message.startswith("policy <policy text>: strict: true and 2 rule(s) matched no ")
    assert "rules[0] (`*self_atn`) matched no site" in message
    assert "rules[1] (class `Bert`) matched no site" in message
    assert "strict: false" in message


LLAMA_SITES = {f"model.layers.{i}.self_attn": "LlamaAttention" for i in range(12)}


def test_an_unmatched_rule_names_the_closest_sites():
    p = policy(r"""
        qattn: 1
        rules:
          - {match: "*self_atn", preset: flash}
          - {match: 're:.*\.self_atn', preset: flash}
          - {match: "model.layer.3.self_attn", preset: flash}
          - {module_class: LlamaAtention, preset: flash}
          - {match: "*self_attn", module_class: "Bert*", preset: flash}
          - {match: "zzzz", preset: flash}
    """)
    lines = p.unmatched_rules(set(), LLAMA_SITES)
    first_three = ", ".join(f"`model.layers.{i}.self_attn`" for i in range(3))
    assert lines == [
        f"rules[0] (`*self_atn`) matched no site; closest sites: {first_three}",
        f"rules[1] (`re:.*\\.self_atn`) matched no site; closest sites: {first_three}",
        "rules[2] (`model.layer.3.self_attn`) matched no site; closest sites: "
        "`model.layers.3.self_attn`, `model.layers.0.self_attn`, `model.layers.1.self_attn`",
        "rules[3] (class `LlamaAtention`) matched no site; closest classes: `LlamaAttention`",
        "rules[4] (`*self_attn`, class `Bert*`) matched no site",  # its match matches sites
        "rules[5] (`zzzz`) matched no site",  # nothing alike
    ]
    assert p.unmatched_rules(set()) == [line.split(";")[0] for line in lines]  # no sites given


def test_the_closest_sites_hint_is_one_bounded_line():
    long_name = "encoder." + "very_long_block_name." * 30 + "attn"
    p = policy("""
        qattn: 1
        rules:
          - {match: "encoder.very_long_block_name*atn", preset: flash}
    """)
    sites = {long_name: None, **{f"{long_name}.{i}": None for i in range(10)}}
    [line] = p.unmatched_rules(set(), sites)
    assert "\n" not in line and line.count("`") == 2 + 2 * 3 and len(line) < 300
    assert "closest sites: `encoder.very_long_block_name.very_long_block_name.very_lo..." in line


def test_check_unmatched_warns_with_the_closest_sites(caplog):
    p = policy("""
        qattn: 1
        rules:
          - {match: "*self_atn", preset: flash}
    """)
    with caplog.at_level(logging.WARNING, logger="qattn_compile.policy"):
        p.check_unmatched(set(), sites={"m.layers.0.self_attn": "A", "m.layers.1.mlp": "M"})
    assert [r.getMessage() for r in caplog.records] == [
        "policy <policy text>: rules[0] (`*self_atn`) matched no site; closest sites: "
        "`m.layers.0.self_attn`"]
    warned = [r.getMessage().split(": ", 1)[1] for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qattn_compile.policy"):  # a later graph
        p.check_unmatched(set(), warned, sites={"m.layers.9.self_attn": "A"})
    assert caplog.records == []  # the rule was warned about, with other closest sites


# ----------------------------------------------------------------------------- round trip


def test_to_yaml_round_trip():
    p = load_policy(FULL)
    text = p.to_yaml()
    again = load_policy(text)
    assert again.to_dict() == p.to_dict()
    assert again.rules == p.rules
    assert again.to_yaml() == text
    for fqn, cls in [("model.layers.0.self_attn", None), ("enc.a", "XAttention"), ("q", None),
                     ("a.vision_tower.b", None)]:
        assert again.decide(fqn, cls) == p.decide(fqn, cls)


def test_to_dict_leaves_out_default_options():
    p = load_policy(RULES.format(rule="{match: x, preset: sage2_8b, "
                                      "options: {qk_granularity: warp, smooth_v: true}}"))
    assert p.rules[2].to_dict() == {"match": "x", "preset": "sage2_8b",
                                    "options": {"smooth_v": True}}
    assert p.rules[0].to_dict() == {"match": "*mlp", "preset": "flash"}


def test_rule_model_can_be_built_directly():
    rule = Rule(match="*attn", preset="sage2_8b", options={"smooth_v": True})
    assert rule.options == Sage2Options(smooth_v=True)
    assert rule.matches("a.attn", None) and not rule.matches("a.mlp", None)


# ----------------------------------------------------------------------------- shipped files


def test_shipped_default_policy():
    p = load_policy(DEFAULT_POLICY_PATH)
    assert p.default == "sage2_8b" and p.default_options == Sage2Options()
    assert p.rules == () and p.ignore == ()
    assert p.on_unsupported == "fallback"
    d = p.decide("model.layers.7.self_attn", "LlamaAttention")
    assert (d.preset, d.options, d.rule_text) == ("sage2_8b", Sage2Options(), "default")


def test_example_policy_shows_every_feature():
    p = load_policy(REPO / "examples" / "policy.yaml")
    assert set(p.model_fields_set) == set(Policy.model_fields)  # every top-level key written
    assert any(pat.startswith("re:") for pat in p.ignore)
    assert any(not pat.startswith("re:") for pat in p.ignore)
    assert any(r.match and r.match.startswith("re:") for r in p.rules)
    assert any(r.module_class and not r.match for r in p.rules)
    assert any(r.module_class and r.match for r in p.rules)
    assert any(r.preset == "none" for r in p.rules)
    first = p.decide("model.layers.0.self_attn")
    assert first.preset == "int_flash"
    assert (first.options.v_granularity, first.options.k_granularity) == ("tensor", "token")
    assert p.decide("model.layers.3.self_attn").preset == "sage2_8b"
    assert p.decide("model.layers.15.self_attn").preset == "none"
    assert p.decide("model.vision_tower.blocks.0.attn").rule_text == "ignore '*vision_tower*'"
    assert p.decide("bert.encoder.layer.0.attention.self", "BertSelfAttention").preset == "fmha_int8"
    assert p.decide("text_model.encoder.layers.0.self_attn", "CLIPSdpaAttention").preset == "turbo"
    assert p.decide("unet.mid.attn1").preset == "flash"
