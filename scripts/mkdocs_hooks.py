"""mkdocs hooks: the command-line reference is generated from leanlm's own parser when the site is built, so it
cannot drift from `leanlm --help`; the benchmarks' plots are served from benchmarks/results/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
CLI_MARKER = "<!-- leanlm-cli-reference -->"


def cli_reference() -> str:
    """Every command's `--help`, as the parser prints it."""
    from leanlm.cli.main import COMMANDS, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    parts = ["```text", parser.format_help().rstrip(), "```"]
    for name in COMMANDS:
        parts += [f"## leanlm {name}", "", "```text", commands[name].format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_files(files, config):
    """Serve benchmarks/results/*.png under results/plots/, where the results pages link them."""
    for png in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
        files.append(File.generated(config, f"results/plots/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
