"""The ``qattn diff`` and ``qattn explain`` subcommands (:func:`add_subcommands`)."""

from __future__ import annotations

import argparse
import sys

from .capture import capture_graphs
from .diff import GraphDiff
from .explain import Explanation
from ..errors import QattnError
from ..specs import SPEC_HELP, ModelSpecError, load_spec

STRICT_EXIT = 1
"""Exit status of ``explain --strict`` when a rule matched nothing or a site fell back."""


def _capture(args):
    """Load the MODEL_SPEC on CPU and capture its graphs with ``--policy``.

    A model that fails on its own example inputs is reported as a :class:`ModelSpecError`
    naming the spec (not a traceback from inside the model)."""
    bundle = load_spec(args.model)
    inputs = bundle.kwargs or bundle.args
    try:
        return capture_graphs(bundle.model, inputs, args.policy), bundle.name
    except QattnError:
        raise
    except Exception as exc:
        raise ModelSpecError(
            f"MODEL_SPEC {args.model!r} ({type(bundle.model).__name__}) failed on its example "
            f"inputs ({', '.join(bundle.kwargs) or 'positional'}): {type(exc).__name__}: {exc}. "
            "Use a module:callable MODEL_SPEC that returns the inputs it needs"
        ) from None


def cmd_diff(args: argparse.Namespace) -> int:
    """Print the unified diff of the graphs; write the HTML page with ``--html``."""
    capture, name = _capture(args)
    diff = GraphDiff(capture, title=f"qattn graph diff: {name}")
    print(diff.text or "(the rewrite changed no graph)")
    print(Explanation(capture).summary(), file=sys.stderr)
    for line in capture.unmatched_rules():
        print(f"warning: {line}", file=sys.stderr)
    if args.html:
        print(f"wrote {diff.write_html(args.html)}", file=sys.stderr)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    """Print the per-site table; with ``--strict``, fail on unmatched rules and fallbacks."""
    capture, _ = _capture(args)
    explanation = Explanation(capture)
    print(explanation.format())
    problems = explanation.problems()
    if args.strict and problems:
        listed = "".join(f"\n  {problem}" for problem in problems)
        print(f"qattn explain --strict: {len(problems)} problem(s):{listed}", file=sys.stderr)
        return STRICT_EXIT
    return 0


def _model_and_policy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_SPEC", help=SPEC_HELP)
    parser.add_argument("--policy", help="policy YAML (default: the bundled sage2_8b policy)")


def add_subcommands(subparsers) -> None:
    """Register ``diff`` and ``explain`` on the ``qattn`` command's subparsers."""
    diff = subparsers.add_parser(
        "diff", help="the dynamo graph before and after the rewrite (text diff, HTML page)",
        description="Trace MODEL_SPEC with dynamo on CPU, rewrite it with the policy, and print "
        "the unified diff of the graph code (no Inductor, no GPU).",
    )
    _model_and_policy(diff)
    diff.add_argument("--html", metavar="OUT.html", help="also write a self-contained side-by-side HTML page")
    diff.set_defaults(func=cmd_diff)

    explain = subparsers.add_parser(
        "explain", help="dry run: what the policy does to every attention site, and why",
        description="Dry run on CPU (no GPU, no Inductor): one row per attention site with its "
        "decision, then the policy rules that matched nothing.",
    )
    _model_and_policy(explain)
    explain.add_argument(
        "--strict", action="store_true",
        help=f"exit with status {STRICT_EXIT} when a rule matched no site or a site fell back",
    )
    explain.set_defaults(func=cmd_explain)
