"""The policy: which attention method every attention site of a model gets.

A policy is a YAML document (README.md, "Policy")::

    qattn: 1                  # schema version (required; only 1 exists)
    default: none             # preset for sites no rule matches; none = leave untouched
    default_options: {}       # options of the default preset
    ignore: ["*vision_tower*", "re:.*\\.cross_attn"]   # FQN patterns; always win
    on_unsupported: fallback  # fallback | error
    strict: false             # true: a rule that matches no site is an error
    rules:                    # ordered; the LAST matching rule wins
      - match: "*self_attn"   # pattern on the module FQN
        preset: sage2_8b
        options: {qk_granularity: block}
      - module_class: BertSelfAttention   # pattern on the module class name
        preset: flash
    kv_cache:                 # optional: the FlashQ KV cache per layer (KVCachePolicy)
      int2_heads: 2

How a site is decided (:meth:`Policy.decide`):

1. A site whose FQN matches an ``ignore`` pattern is left alone, whatever the rules say.
2. Otherwise the last rule that matches the site wins. A rule gives ``match`` (module FQN),
   ``module_class`` (class name), or both; with both, both must match. A ``module_class``
   rule never matches a site whose class is unknown.
3. Otherwise the site gets ``default`` with ``default_options``.

Patterns: ``re:<regex>`` is matched with :func:`re.fullmatch`; anything else is a glob matched
with :func:`fnmatch.fnmatchcase` (case-sensitive; ``*`` also crosses dots). Validation is
strict: unknown keys are errors, options are checked against the preset
(:func:`qattn_compile.presets.resolve_options`), and every error is one
:class:`~qattn_compile.errors.PolicyError` paragraph naming the file, the rule, the field and
what is allowed.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import logging
import os
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .blocks import KV_CACHE_BLOCK
from .errors import PolicyError
from .messages import (
    SHOWN_CHARS,
    SHOWN_PROBLEMS,
    describe_value,
    join_problems,
    problem_sentence,
    short_repr,
)
from .presets import PRESET_NAMES, NoOptions, PresetOptions, option_names, resolve_options

logger = logging.getLogger("qattn_compile.policy")

SCHEMA_VERSION = 1
"""The only ``qattn:`` schema version this module reads."""
TEXT_SOURCE = "<policy text>"
"""``Policy.source`` of a policy parsed from YAML text."""
DICT_SOURCE = "<policy dict>"
"""``Policy.source`` of a policy built from a dict."""
_SOURCE_BEING_BUILT: ContextVar[str] = ContextVar("qattn_policy_source", default=DICT_SOURCE)
"""What :meth:`Policy.__init__`'s error messages call the policy: :meth:`Policy.from_dict`'s
``source`` while it builds one."""
DEFAULT_POLICY_PATH = Path(__file__).parent / "data" / "policies" / "default.yaml"
"""The shipped default policy: ``sage2_8b`` on every attention site."""
REGEX_PREFIX = "re:"
"""Prefix that turns a pattern into a regular expression (matched with ``re.fullmatch``)."""

_YAML_SUFFIXES = (".yaml", ".yml")
MAX_YAML_DEPTH = 32
"""The deepest nesting of YAML collections a policy may have (its own needs about 8)."""
MAX_YAML_VALUES = 500_000
"""The most values (scalars and collections, each alias counted as what it stands for) a
policy's YAML may hold: a few bytes of nested aliases can stand for billions of values."""


# --------------------------------------------------------------------------- patterns


@functools.lru_cache(maxsize=4096)
def _matcher(pattern: str) -> Callable[[str], bool]:
    """Compile ``pattern`` once; raise ValueError if it is empty or a bad regex."""
    if pattern.startswith(REGEX_PREFIX):
        body = pattern[len(REGEX_PREFIX) :]
        if not body:
            raise ValueError(f"empty regular expression {short_repr(pattern)}")
        try:
            regex = re.compile(body)
        except re.error as exc:
            raise ValueError(f"bad regular expression {short_repr(pattern)}: {exc}") from None
        return lambda name: regex.fullmatch(name) is not None
    if not pattern:
        raise ValueError("empty pattern")
    if (opened := _unclosed_bracket(pattern)) is not None:
        raise ValueError(f"unclosed `[` at position {opened} of glob {short_repr(pattern)} "
                         "(a glob reads it as a literal `[`, which no module or class name "
                         "holds; `[[]` matches a literal `[`)")
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def _unclosed_bracket(pattern: str) -> int | None:
    """The position of a ``[`` that opens no set in glob ``pattern`` (scanned as
    :func:`fnmatch.translate` does: a set may start with ``!`` and then ``]``), or None."""
    i = 0
    while i < len(pattern):
        if pattern[i] == "[":
            j = i + 1
            j += j < len(pattern) and pattern[j] == "!"
            j += j < len(pattern) and pattern[j] == "]"
            close = pattern.find("]", j)
            if close < 0:
                return i
            i = close
        i += 1
    return None


def match_pattern(pattern: str, name: str) -> bool:
    """True if ``name`` matches a policy pattern (``re:<regex>`` fullmatch, else a glob)."""
    return _matcher(pattern)(name)


def _check_pattern(value: str | None) -> str | None:
    if value is not None:
        _matcher(value)
    return value


def _check_preset_name(value: Any) -> str:
    if value is None:
        raise ValueError(f"is empty; choose one of: {', '.join(PRESET_NAMES)}")
    if not isinstance(value, str) or value not in PRESET_NAMES:
        raise ValueError(f"unknown preset {short_repr(value)}; choose one of: "
                         f"{', '.join(PRESET_NAMES)}")
    return value


def _resolve(preset: str | None, options: Any) -> PresetOptions:
    """Validate raw ``options`` for ``preset`` (None when the preset itself was bad)."""
    if preset is None:
        return NoOptions()
    if options is None:
        options = {}
    if not isinstance(options, (Mapping, PresetOptions)):
        raise ValueError(
            f"options must be a mapping of option names to values, got {describe_value(options)}; "
            f"options of preset {preset!r}: {option_names(preset)}"
        )
    if isinstance(options, Mapping):
        bad = [k for k in options if not isinstance(k, str)]
        if bad:
            raise ValueError(
                f"option names must be strings, got {short_repr(bad[0])}; "
                f"options of preset {preset!r}: {option_names(preset)}"
            )
        options = dict(options)
    return resolve_options(preset, options)


def _empty_if_none(value: Any) -> Any:
    return () if value is None else value


# --------------------------------------------------------------------------- models


class Rule(BaseModel):
    """One entry of ``rules:``: which sites it matches and the preset they get."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: StrictStr | None = Field(
        None, description="Pattern on the module FQN (glob, or `re:` + regex fullmatch)."
    )
    module_class: StrictStr | None = Field(
        None, description="Pattern on the module class name (exact name, glob or `re:`)."
    )
    preset: str = Field(description="Preset the matched sites get (see presets.PRESET_NAMES).")
    options: SerializeAsAny[PresetOptions] = Field(
        None, validate_default=True, description="Preset options, resolved with defaults."
    )

    _preset_ok = field_validator("preset", mode="before")(_check_preset_name)
    _patterns_ok = field_validator("match", "module_class")(_check_pattern)

    @field_validator("options", mode="before")
    @classmethod
    def _options_ok(cls, value: Any, info: ValidationInfo) -> PresetOptions:
        return _resolve(info.data.get("preset"), value)

    @model_validator(mode="after")
    def _has_a_matcher(self) -> Rule:
        if self.match is None and self.module_class is None:
            raise ValueError(
                "a rule needs `match:` (a module FQN pattern) or `module_class:` "
                "(a class name pattern), or both"
            )
        return self

    def matches(self, fqn: str, module_class: str | None) -> bool:
        """True if this rule applies to the site ``fqn`` whose module class is ``module_class``."""
        if self.match is not None and not match_pattern(self.match, fqn):
            return False
        if self.module_class is not None:
            return module_class is not None and match_pattern(self.module_class, module_class)
        return True

    def short_label(self) -> str:
        """How "matched no site" lines name this rule: its match and/or class in backticks."""
        parts = [f"`{_clip(self.match)}`"] if self.match is not None else []
        if self.module_class is not None:
            parts.append(f"class `{_clip(self.module_class)}`")
        return ", ".join(parts)

    def describe(self, index: int) -> str:
        """How messages name this rule, e.g. ``rules[2] (match '*self_attn')``."""
        return f"rules[{index}] ({_rule_label(self.match, self.module_class)})"

    def to_dict(self) -> dict[str, Any]:
        """The rule as YAML would spell it (options that equal their default left out)."""
        out: dict[str, Any] = {}
        if self.match is not None:
            out["match"] = self.match
        if self.module_class is not None:
            out["module_class"] = self.module_class
        out["preset"] = self.preset
        options = self.options.model_dump(mode="json", exclude_defaults=True)
        if options:
            out["options"] = options
        return out


@dataclass(frozen=True)
class Decision:
    """What the policy says about one attention site."""

    preset: str
    """Preset to apply; ``"none"`` means leave the site alone."""
    options: PresetOptions
    """The preset's options, defaults filled in."""
    rule_index: int | None
    """Index into ``Policy.rules`` of the winning rule; None for the default or an ignore."""
    rule_text: str
    """Which entry decided: ``rules[2] (match '*self_attn')``, ``default`` or ``ignore '*vit*'``."""
    reason: str
    """Human-readable explanation of the choice."""
    matched_rules: tuple[int, ...] = ()
    """Indices of every rule whose pattern matches the site, the winner and those it
    overrides (also when an ignore pattern wins): what ``strict`` counts as a rule matching
    a site."""


# --------------------------------------------------------------------------- kv cache


def _check_buffer_tokens(value: int | None) -> int | None:
    if value is not None and value % KV_CACHE_BLOCK:
        raise ValueError(f"buffer_tokens must be a multiple of {KV_CACHE_BLOCK} (the cache block), got {value}")
    return value


class KVCacheLayer(BaseModel):
    """How one attention layer's KV cache is stored (``qattn_compile.kvcache``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["flashq", "none"] = Field(
        "flashq", description="flashq: FlashQ INT4/INT2 blocks + INT8 buffer; none: model dtype."
    )
    int2_heads: StrictInt = Field(
        0, ge=0, description="KV heads of the layer stored in INT2 (lowest priority); the rest INT4."
    )
    buffer_tokens: StrictInt = Field(
        KV_CACHE_BLOCK, gt=0, description="INT8 decode buffer n_b (a multiple of the cache block)."
    )

    _buffer_ok = field_validator("buffer_tokens")(_check_buffer_tokens)


class KVCacheRule(BaseModel):
    """One entry of ``kv_cache.rules``: the layers it matches and the fields it overrides."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: StrictStr = Field(description="Pattern on the attention module FQN (glob or `re:`).")
    format: Literal["flashq", "none"] | None = None
    int2_heads: StrictInt | None = Field(None, ge=0)
    buffer_tokens: StrictInt | None = Field(None, gt=0)

    _pattern_ok = field_validator("match")(_check_pattern)
    _buffer_ok = field_validator("buffer_tokens")(_check_buffer_tokens)


class KVCachePolicy(KVCacheLayer):
    """The ``kv_cache:`` block: layer defaults plus ordered rules (the last match wins)::

        kv_cache:
          format: flashq        # flashq | none
          int2_heads: 2         # per layer
          buffer_tokens: 64
          rules:
            - match: "*layers.0.self_attn"
              int2_heads: 0
    """

    rules: tuple[KVCacheRule, ...] = Field((), description="Ordered per-layer overrides.")

    _rules_ok = field_validator("rules", mode="before")(_empty_if_none)

    def defaults(self) -> KVCacheLayer:
        """The settings of a layer no rule matches."""
        return KVCacheLayer(format=self.format, int2_heads=self.int2_heads, buffer_tokens=self.buffer_tokens)

    def for_layer(self, fqn: str) -> KVCacheLayer:
        """Settings of the layer whose attention module is ``fqn`` (last matching rule wins)."""
        base = self.defaults()
        for rule in reversed(self.rules):
            if match_pattern(rule.match, fqn):
                fields = rule.model_dump(exclude={"match"}, exclude_none=True)
                return KVCacheLayer(**{**base.model_dump(), **fields})
        return base

    def to_dict(self) -> dict[str, Any]:
        """The block as YAML would spell it."""
        out = self.model_dump(exclude={"rules"})
        out["rules"] = [rule.model_dump(exclude_none=True) for rule in self.rules]
        return out


def _kv_cache_problems(exc: ValidationError, data: Mapping[str, Any]) -> str:
    """One sentence per error inside ``kv_cache:``, naming the rule and the field."""
    sentences = []
    for error in exc.errors()[:SHOWN_PROBLEMS]:
        loc, model, place = tuple(error["loc"]), KVCachePolicy, ""
        if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
            rules = data.get("rules")
            raw = rules[loc[1]] if isinstance(rules, list) and loc[1] < len(rules) else None
            label = f" (match {_quote(raw['match'])})" if isinstance(raw, Mapping) and "match" in raw else ""
            place, loc, model = f"rules[{loc[1]}]{label}", loc[2:], KVCacheRule
        if error["type"] in ("extra_forbidden", "missing"):
            text = _problem(error, model, str(loc[-1]) if loc else "")
        else:
            field = f"field `{loc[0]}`" if loc else ""
            text = ": ".join(p for p in (field, _problem(error, model, "")) if p)
        sentences.append(": ".join(p for p in (place, text) if p))
    return join_problems(sentences, exc.error_count())


class Policy(BaseModel):
    """A validated policy. Build it with :func:`load_policy`, :meth:`from_dict`,
    :meth:`from_yaml`, :meth:`from_file` or its fields as keywords; ask it with :meth:`decide`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    qattn: Literal[1] = Field(description="Schema version; required, only 1 exists.")
    default: str = Field("none", description="Preset for sites no rule matches.")
    default_options: SerializeAsAny[PresetOptions] = Field(
        None, validate_default=True, description="Options of the default preset, resolved."
    )
    ignore: tuple[StrictStr, ...] = Field((), description="FQN patterns left alone; always win.")
    on_unsupported: Literal["fallback", "error"] = Field(
        "fallback", description="What to do with a site the chosen kernel cannot serve."
    )
    strict: StrictBool = Field(False, description="A rule that matches no site is an error.")
    rules: tuple[Rule, ...] = Field((), description="Ordered rules; the last match wins.")
    kv_cache: KVCachePolicy | None = Field(None, description="FlashQ KV cache per layer (optional).")

    _source: str = PrivateAttr(DICT_SOURCE)

    def __init__(self, /, **data: Any) -> None:
        """``Policy(qattn=1, rules=[...])``: the fields as keywords, checked as
        :meth:`from_dict` checks them (a bad one raises :class:`PolicyError`)."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise PolicyError(_explain(exc, data, _SOURCE_BEING_BUILT.get())) from None

    @field_validator("qattn", mode="before")
    @classmethod
    def _version_ok(cls, value: Any) -> int:
        if type(value) is not int or value != SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema version {short_repr(value)}; this qattn reads only "
                f"`qattn: {SCHEMA_VERSION}`"
            )
        return value

    _default_ok = field_validator("default", mode="before")(_check_preset_name)
    _lists_ok = field_validator("ignore", "rules", mode="before")(_empty_if_none)

    @field_validator("default_options", mode="before")
    @classmethod
    def _default_options_ok(cls, value: Any, info: ValidationInfo) -> PresetOptions:
        return _resolve(info.data.get("default"), value)

    @field_validator("kv_cache", mode="before")
    @classmethod
    def _kv_cache_ok(cls, value: Any) -> KVCachePolicy | None:
        if value is None or isinstance(value, KVCachePolicy):
            return value
        if not isinstance(value, Mapping):
            allowed = ", ".join(KVCachePolicy.model_fields)
            raise ValueError(
                f"must be a mapping, got {describe_value(value)}; allowed keys: {allowed}")
        try:
            return KVCachePolicy.model_validate(dict(value))
        except ValidationError as exc:
            raise ValueError(_kv_cache_problems(exc, value)) from None

    @field_validator("ignore")
    @classmethod
    def _ignore_ok(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for i, pattern in enumerate(value):
            try:
                _matcher(pattern)
            except ValueError as exc:
                raise ValueError(f"ignore[{i}]: {exc}") from None
        return value

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = DICT_SOURCE) -> Policy:
        """Validate a parsed policy; ``source`` names it in error messages."""
        if not isinstance(data, Mapping):
            raise PolicyError(
                f"policy {source}: the top level must be a mapping (`qattn: 1`, `rules: [...]`, "
                f"...), got {describe_value(data)}"
            )
        stray = next((key for key in data if not isinstance(key, str)), None)
        if stray is not None:
            raise PolicyError(f"policy {source}: key {short_repr(stray)} is not a string; "
                              f"allowed keys: {', '.join(cls.model_fields)}")
        token = _SOURCE_BEING_BUILT.set(source)
        try:
            policy = cls(**data)
        finally:
            _SOURCE_BEING_BUILT.reset(token)
        policy._source = source
        return policy

    @classmethod
    def from_yaml(cls, text: str, source: str = TEXT_SOURCE) -> Policy:
        """Parse and validate YAML text; bad syntax is reported with line and column."""
        try:
            _check_yaml_shape(text)
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            context = f" ({exc.context})" if exc.context else ""
            raise PolicyError(f"policy {source}: bad YAML{where}: {exc.problem}{context}") from None
        except yaml.YAMLError as exc:
            raise PolicyError(f"policy {source}: bad YAML: {exc}") from None
        if data is None:
            raise PolicyError(f"policy {source}: the policy is empty; it needs at least `qattn: 1`")
        return cls.from_dict(data, source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Policy:
        """Read, parse and validate a policy file."""
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PolicyError(f"policy file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"cannot read policy file {path}: {exc}") from None
        return cls.from_yaml(text, source=str(path))

    @property
    def source(self) -> str:
        """Where the policy came from: its file path, ``<policy text>`` or ``<policy dict>``."""
        return self._source

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form; ``Policy.from_dict(p.to_dict())`` gives an equal policy."""
        return {
            "qattn": self.qattn,
            "default": self.default,
            "default_options": self.default_options.model_dump(mode="json", exclude_defaults=True),
            "ignore": list(self.ignore),
            "on_unsupported": self.on_unsupported,
            "strict": self.strict,
            "rules": [rule.to_dict() for rule in self.rules],
        } | ({"kv_cache": self.kv_cache.to_dict()} if self.kv_cache is not None else {})

    def to_yaml(self) -> str:
        """YAML text of this policy; :func:`load_policy` reads it back to an equal policy."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    # ----------------------------------------------------------------- decisions

    def decide(self, fqn: str, module_class: str | None = None) -> Decision:
        """Decide the preset of the attention site at module ``fqn`` (class ``module_class``)."""
        hits = [i for i, rule in enumerate(self.rules) if rule.matches(fqn, module_class)]
        for pattern in self.ignore:
            if match_pattern(pattern, fqn):
                return Decision(
                    "none", NoOptions(), None, f"ignore '{pattern}'",
                    f"'{fqn}' matches ignore pattern '{pattern}' (ignore always wins): left alone",
                    tuple(hits),
                )
        if hits:
            index = hits[-1]
            rule = self.rules[index]
            text = rule.describe(index)
            reason = f"{text} is the last rule matching '{fqn}'"
            if len(hits) > 1:
                reason += f" (it overrides {', '.join(f'rules[{i}]' for i in hits[:-1])})"
            reason += ": left alone" if rule.preset == "none" else f": preset {rule.preset}"
            return Decision(rule.preset, rule.options, index, text, reason, tuple(hits))
        site = f"'{fqn}'" + (f" (class {module_class})" if module_class else "")
        outcome = "left alone" if self.default == "none" else f"preset {self.default}"
        reason = f"no rule matches {site}; the default applies: {outcome}"
        return Decision(self.default, self.default_options, None, "default", reason)

    def unmatched_rules(self, matched_indices: Collection[int],
                        sites: Mapping[str, str | None] | None = None) -> list[str]:
        """One line per rule whose index is not in ``matched_indices`` (the union of the
        sites' :attr:`Decision.matched_rules`). ``sites`` (each site's FQN and module class)
        adds to a rule's line the site names, or class names, closest to a pattern of it
        that matches none, e.g. ``rules[0] (`*self_atn`) matched no site; closest sites:
        `layers.0.self_attn`, ...``."""
        unmatched = [(i, rule) for i, rule in enumerate(self.rules) if i not in matched_indices]
        if not unmatched:
            return []
        names = _NameIndex([fqn for fqn in sites or {} if fqn])
        classes = _NameIndex([cls for cls in (sites or {}).values() if cls])
        return [
            f"rules[{i}] ({rule.short_label()}) matched no site"
            + names.hint("sites", rule.match) + classes.hint("classes", rule.module_class)
            for i, rule in unmatched
        ]

    def with_strict(self, strict: bool) -> Policy:
        """A copy of this policy with ``strict`` replaced (the backend's ``strict`` option)."""
        return self.model_copy(update={"strict": strict})

    def check_unmatched(self, matched_indices: Collection[int], warned: Collection[str] = (),
                        sites: Mapping[str, str | None] | None = None) -> list[str]:
        """Warn about every rule that matched no site (except the descriptions in ``warned``,
        already given, whatever closest sites they named); with ``strict: true`` raise
        instead. ``sites`` as in :meth:`unmatched_rules`.

        Returns the descriptions (empty when every rule matched something).
        """
        unmatched = self.unmatched_rules(matched_indices, sites)
        given = {text.split(_HINT_SEPARATOR)[0] for text in warned}
        for text in unmatched:
            if text.split(_HINT_SEPARATOR)[0] not in given:
                logger.warning("policy %s: %s", self.source, text)
        if unmatched and self.strict:
            raise PolicyError(
                f"policy {self.source}: strict: true and {len(unmatched)} rule(s) matched no "
                f"attention site: {join_problems(unmatched)}. Fix or remove them, or set "
                f"`strict: false` to only warn"
            )
        return unmatched


def load_policy(source: Policy | str | os.PathLike[str] | Mapping[str, Any]) -> Policy:
    """Load a policy from a :class:`Policy` (returned as is), a file path, a dict or YAML text.

    A str is a path if it names an existing file; otherwise it is YAML text if it contains a
    newline or a ``:``. A one-line str that ends in ``.yaml``/``.yml`` or has no ``:`` and names
    no file raises ``PolicyError("policy file not found: ...")``.
    """
    if isinstance(source, Policy):
        return source
    if isinstance(source, Mapping):
        return Policy.from_dict(source)
    if isinstance(source, os.PathLike):
        return Policy.from_file(source)
    if not isinstance(source, str):
        raise PolicyError(
            f"cannot load a policy from {describe_value(source)}; pass a file path, YAML text, "
            f"a dict or a Policy"
        )
    if "\n" not in source and source.strip():
        if _path_is(source, Path.is_file):
            return Policy.from_file(source)
        if _path_is(source, Path.is_dir):
            raise PolicyError(f"policy path {source} is a directory, not a policy file")
        if source.strip().endswith(_YAML_SUFFIXES) or ":" not in source:
            raise PolicyError(f"policy file not found: {source}")
    return Policy.from_yaml(source)


# --------------------------------------------------------------------------- helpers


_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML was built with it (several times faster on large policies)."""


def _check_yaml_shape(text: str) -> None:
    """Refuse, from the parser's events and before anything is composed, a document nested
    deeper than :data:`MAX_YAML_DEPTH` (PyYAML's composer recurses per level, so deep
    nesting ends in a RecursionError) or whose aliases expand to more than
    :data:`MAX_YAML_VALUES` values (an alias bomb: cheap to load, since aliases share one
    object, but anything that walks the value, a validator or an error message, walks every
    copy). Raises ``yaml.composer.ComposerError`` with the offending event's mark."""
    counts = [0]  # values of each open collection so far (the outermost: the document)
    anchors: dict[str, int] = {}  # values each anchored node stands for
    opened: list[str | None] = []  # the anchor of each open collection
    for event in yaml.parse(text, Loader=_SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(opened) >= MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark)
            counts.append(0)
            opened.append(event.anchor)
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            values, anchor = 1 + counts.pop(), opened.pop()
        elif isinstance(event, yaml.ScalarEvent):
            values, anchor = 1, event.anchor
        elif isinstance(event, yaml.AliasEvent):
            values, anchor = anchors.get(event.anchor, 1), None
        else:
            continue
        if anchor is not None:
            anchors[anchor] = values
        counts[-1] += values
        if counts[-1] > MAX_YAML_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand to more than {MAX_YAML_VALUES} values (an alias "
                "bomb?); write the values out, or alias less", event.start_mark)


class _UniqueKeyLoader(_SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last). An
    integer of more digits than Python converts is a YAML error too, not int()'s ValueError.
    Nesting and alias expansion are checked before it runs (:func:`_check_yaml_shape`)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than int() converts
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of more than {sys.get_int_max_str_digits()} digits",
                node.start_mark) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short_repr(key)}", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


_HINT_SEPARATOR = "; closest "
"""What starts the closest-names hint of an unmatched rule's line."""


class _NameIndex:
    """Site (or class) names, to find those closest to a pattern that matches none of them.

    A name is compared whole and by each of its dotted tails (``layers.0.self_attn``,
    ``0.self_attn``, ``self_attn``), so that the short pattern ``*self_atn`` finds the long
    FQN it was meant for; the pattern's literal text is compared (:func:`_literal_text`).
    """

    SHOWN = 3
    """The most names one hint gives."""
    CUTOFF = 0.6
    """The least similarity (:meth:`difflib.SequenceMatcher.ratio`) of a name shown."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(dict.fromkeys(names))
        self.by_tail: dict[str, list[str]] = {}
        for name in self.names:
            parts = name.split(".")
            for i in range(len(parts)):
                self.by_tail.setdefault(".".join(parts[i:]), []).append(name)

    def closest(self, pattern: str) -> list[str]:
        """Up to :attr:`SHOWN` names most like ``pattern``, best first (none when a name
        matches it, or none is alike)."""
        if any(match_pattern(pattern, name) for name in self.names):
            return []
        # difflib.get_close_matches's test, with ties kept in the sites' order
        matcher = difflib.SequenceMatcher()
        matcher.set_seq2(_literal_text(pattern)[: 4 * SHOWN_CHARS])
        scored = []
        for order, tail in enumerate(self.by_tail):
            matcher.set_seq1(tail)
            if (matcher.real_quick_ratio() >= self.CUTOFF and matcher.quick_ratio() >= self.CUTOFF
                    and (ratio := matcher.ratio()) >= self.CUTOFF):
                scored.append((-ratio, order, tail))
        found: list[str] = []
        for _, _, tail in sorted(scored):
            found.extend(name for name in self.by_tail[tail] if name not in found)
            if len(found) >= self.SHOWN:
                break
        return found[: self.SHOWN]

    def hint(self, what: str, pattern: str | None) -> str:
        """``"; closest sites: `a`, `b`"``, or "" when there is nothing to say."""
        close = self.closest(pattern) if pattern is not None and self.names else []
        if not close:
            return ""
        return f"{_HINT_SEPARATOR}{what}: " + ", ".join(f"`{_clip(name)}`" for name in close)


def _literal_text(pattern: str) -> str:
    """The literal text of a policy pattern: a glob without its wildcards, a regex without
    its syntax (``re:.*\\.self_atn`` -> ``.self_atn``)."""
    if pattern.startswith(REGEX_PREFIX):
        body = re.sub(r"\.[*+?]", "", pattern[len(REGEX_PREFIX):])
        return re.sub(r"\\(.)|[\^$()|*+?{}\[\]]", lambda m: m.group(1) or "", body)
    return re.sub(r"[*?\[\]!]", "", pattern)


def _children(node: yaml.Node) -> list[yaml.Node]:
    """The nodes a YAML collection node holds (a mapping's keys and values); none for a
    scalar."""
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return node.value
    return []


def _path_is(text: str, test: Callable[[Path], bool]) -> bool:
    """``test`` (``Path.is_file``, ``Path.is_dir``) of the path ``text`` names; False when
    ``text`` cannot be a path."""
    try:
        return test(Path(text).expanduser())
    except (OSError, ValueError):  # name too long, NUL byte, ...
        return False


def _quote(value: Any) -> str:
    """``'text'`` for a string (no repr escaping of backslashes), repr otherwise; cut to
    :data:`~qattn_compile.messages.SHOWN_CHARS` characters either way."""
    return f"'{_clip(value)}'" if isinstance(value, str) else short_repr(value)


def _clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    text = text[: limit + 1].replace("\n", "\\n")  # only what is shown is scanned
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _rule_label(match: Any, module_class: Any) -> str:
    named = (("match", match), ("module_class", module_class))
    parts = [f"{key} {_quote(value)}" for key, value in named if value is not None]
    return ", ".join(parts) or "no match or module_class"


def _where(loc: tuple, data: Mapping[str, Any]) -> tuple[str, tuple]:
    """Split a pydantic error location into a readable place and the rest of the location."""
    if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
        rules = data.get("rules")
        raw = rules[loc[1]] if isinstance(rules, list) and loc[1] < len(rules) else None
        if isinstance(raw, Mapping):
            label = _rule_label(raw.get("match"), raw.get("module_class"))
            return f"rules[{loc[1]}] ({label})", loc[2:]
        return f"rules[{loc[1]}]", loc[2:]
    if len(loc) >= 2 and isinstance(loc[1], int):
        return f"{loc[0]}[{loc[1]}]", loc[2:]
    return "", loc


def _problem(error: dict, model: type[BaseModel], field: str) -> str:
    """:func:`~qattn_compile.messages.problem_sentence` with the policy's hints for its
    required keys."""
    hints = {"qattn": " (the schema version: write `qattn: 1`)",
             "preset": f"; choose one of: {', '.join(PRESET_NAMES)}"}
    return problem_sentence(error, model, field, hints)


def _explain(exc: ValidationError, data: Mapping[str, Any], source: str) -> str:
    """Turn a pydantic ValidationError into one paragraph naming file, rule, field, allowed."""
    sentences = []
    for error in exc.errors()[:SHOWN_PROBLEMS]:
        place, rest = _where(tuple(error["loc"]), data)
        in_rule = place.startswith("rules[")
        model = Rule if in_rule else Policy
        if error["type"] in ("model_type", "model_attributes_type") and in_rule:
            text = f"{place}: a rule {_problem(error, Rule, '')}"
        elif error["type"] in ("extra_forbidden", "missing"):
            text = _problem(error, model, str(rest[-1]) if rest else "")
            text = f"{place}: {text}" if place else text
        else:
            field = f"field `{rest[0]}`" if rest else ""
            text = ": ".join(p for p in (place, field, _problem(error, model, "")) if p)
        sentences.append(text)
    return f"policy {source}: " + join_problems(sentences, exc.error_count(), sep=". ")
