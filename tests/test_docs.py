"""The documentation: the MkDocs site builds strictly, every `python -m moe_grpo.train ...` command in the README and
in docs/ composes with Hydra into a valid config, and the README stays a front page (<= 15 KB, links that resolve).

The site and the commands are checked here, not by eye, so the docs cannot drift from the code: a renamed key, a
moved page or a broken link fails the suite.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moe_grpo.config import from_hydra

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_LIMIT = 15 * 1024
TRAIN = re.compile(r"(?:\S*/)?python -m moe_grpo\.train\b")
# Placeholders the docs write in a command template, and what stands in for them here; any other `<...>` fails.
PLACEHOLDERS = {"<head>": "10.0.0.5", "<your overrides>": ""}
HYDRA_FLAGS = {"--help", "--hydra-help", "--info"}  # Hydra's own flags: they print, they set no key


def markdown_files() -> list[Path]:
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "figures" not in p.parts)]


def train_commands(text: str) -> list[tuple[int, str]]:
    """(line, arguments) of every `python -m moe_grpo.train` command in a Markdown text: in fenced blocks (lines
    joined where they end in a backslash, `# comments` cut) and in inline code spans of the prose (a span may wrap
    across lines of its paragraph)."""
    found: list[tuple[int, str]] = []
    lines = text.split("\n")
    i, fence, para, para_start = 0, False, [], 0

    def flush_paragraph():
        joined = " ".join(para)
        for span in re.findall(r"`([^`]*)`", joined):
            m = TRAIN.search(span)
            if m:
                found.append((para_start + 1, span[m.end():].strip()))

    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            flush_paragraph()
            para = []
            fence = not fence
            i += 1
            continue
        if fence:
            start = i
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            m = TRAIN.search(line)
            if m:
                found.append((start + 1, " ".join(re.split(r"\s#", line[m.end():])[0].split())))
            i += 1
            continue
        if not line.strip():
            flush_paragraph()
            para = []
        else:
            if not para:
                para_start = i
            para.append(line)
        i += 1
    flush_paragraph()
    return found


def all_commands() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)}:{line}", args) for path in markdown_files()
            for line, args in train_commands(path.read_text())]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_grpo.config import CONF_DIR, defaults_tree

    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def stand_in_checkpoint(path: str, tmp_path: Path) -> str:
    """The docs' example checkpoints (`init.hf=/ckpt/qwen3_moe`) are not on this machine: a directory with the
    config.json of the family the name says stands in, so the other keys are checked against a real model spec."""
    if Path(path).is_dir():
        return path
    from moe_grpo.models.hf_config import write_hf_config

    family = "qwen3_moe_1b_64e" if "qwen3" in path.lower() else "deepseek_v3_tiny"
    spec = from_hydra(compose([f"model={family}"])).model
    out = tmp_path / Path(path).name
    out.mkdir()
    write_hf_config(spec, out)
    return str(out)


def test_the_extractor_finds_the_commands_prose_and_blocks_hold():
    """Guards the command test below against passing by finding nothing: README command 1 and a wrapped,
    commented, multi-line command are found with their arguments."""
    text = ("x\n```bash\nbash tools/install.sh engine && .venv/bin/python -m moe_grpo.train model=deepseek_moe\n"
            "FOO=1 python -m moe_grpo.train a=1 \\\n    b=2   # note\n```\nprose (`python -m moe_grpo.train\nc=3`).\n")
    assert train_commands(text) == [(3, "model=deepseek_moe"), (4, "a=1 b=2"), (7, "c=3")]
    commands = all_commands()
    assert any(where.startswith("README.md:") and args == "model=deepseek_moe" for where, args in commands)
    assert len(commands) >= 20


@pytest.mark.parametrize("where, args", all_commands())
def test_every_documented_train_command_composes(where, args, tmp_path):
    """Each `python -m moe_grpo.train ...` of the README and docs/, composed by Hydra from conf/ and converted by
    `from_hydra` as the command would (config only, nothing runs): a key renamed in the code, a value out of range
    or a typo in the docs fails here with the file and line."""
    overrides = []
    for placeholder, stand_in in PLACEHOLDERS.items():
        args = args.replace(placeholder, stand_in)
    assert "<" not in args, f"{where}: a placeholder this test does not know: {args}"
    for word in shlex.split(args):
        if word.startswith("-"):
            assert word in HYDRA_FLAGS, f"{where}: unknown flag {word}"
            continue
        key, _, value = word.partition("=")
        assert _ == "=", f"{where}: {word!r} is not a key=value override"
        if key == "init.hf":
            word = f"init.hf={stand_in_checkpoint(value, tmp_path)}"
        overrides.append(word)
    try:
        from_hydra(compose(overrides))
    except Exception as e:  # noqa: BLE001 - report where the command is written
        pytest.fail(f"{where}: python -m moe_grpo.train {args}\n  -> {type(e).__name__}: {e}")


def dry_run_transcripts() -> list[tuple[str, dict[str, str], list[str], list[str]]]:
    """(where, environment, arguments, printed lines) of every fenced block of the docs that starts with a
    `$ ... python -m moe_grpo.train ... cluster.dry_run=true` line (continued with backslashes), then its output."""
    found = []
    for path in markdown_files():
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", path.read_text(), flags=re.M | re.S)
        for block in blocks:
            lines = block.rstrip("\n").split("\n")
            if not lines[0].startswith("$ ") or "cluster.dry_run=true" not in block:
                continue
            command, i = lines[0][2:], 0
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            words = shlex.split(command)
            env = dict(w.split("=", 1) for w in words[:words.index("python")])
            where = f"{path.relative_to(ROOT)}: {command[:60]}..."
            found.append((where, env, words[words.index("moe_grpo.train") + 1:], lines[i + 1:]))
    return found


def test_the_docs_dry_run_transcripts_are_what_the_command_prints_today():
    """A plan printed in the docs is run again (`cluster.dry_run=true` starts nothing: ~2 s) and must be what it
    prints now, line for line. Would have caught: the SLURM guide's Qwen3-30B-A3B plan shown as "plan: OK" at
    70.1 GiB a rank while the command as written was refused at 86.5 GiB (the mismatch probe's copies, counted since),
    and without the checkpoint line the plan prints since."""
    transcripts = dry_run_transcripts()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MOE_GRPO_"))}  # what the plan reads
    assert transcripts, "the SLURM guide's transcript is found"
    for where, env, args, printed in transcripts:
        out = subprocess.run([sys.executable, "-m", "moe_grpo.train", *args], capture_output=True, text=True,
                             timeout=120, cwd=ROOT, env={**clean, **env})
        assert out.stdout.rstrip("\n").split("\n") == printed, (
            f"{where}: exit {out.returncode}, printed today:\n{out.stdout}{out.stderr[-2000:]}")


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` into a temp dir: a broken link or anchor, or a page left out of the navigation, is a
    warning mkdocs.yml's `validation` raises, and strict turns it into a failed build."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                          "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_strict_build_checks_anchors_and_the_navigation():
    """Without these settings mkdocs 1.6 only logs a broken anchor or a page missing from `nav` (info level), and
    the strict build passes."""
    import yaml

    validation = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", ""))["validation"]
    assert validation["omitted_files"] == "warn" and validation["anchors"] == "warn"
    assert validation["unrecognized_links"] == "warn"


def test_the_readme_is_a_front_page_with_links_that_resolve():
    """README <= 15 KB, its two commands first, and every relative link it holds names a file that exists."""
    text = README.read_text()
    size = len(text.encode())
    assert size <= README_LIMIT, f"README.md is {size} B, over {README_LIMIT} B: move the detail into docs/"
    first_block = text.split("```")[1]
    assert "bash tools/install.sh engine && .venv/bin/python -m moe_grpo.train model=deepseek_moe" in first_block
    assert "bash tools/install.sh engine && .venv/bin/python -m pytest -q --durations=25 tests" in first_block
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
