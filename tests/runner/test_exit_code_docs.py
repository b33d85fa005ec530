"""README's "## Exit codes" table, `batchrun --help` and the ExitCode enum say the same thing."""
import re

from click.testing import CliRunner

from batchrun.cli import main
from batchrun.job.exit_codes import MEANINGS, ExitCode
from tests.helpers.jobs import REPO


def readme_table() -> dict[int, str]:
    """code -> meaning, from the markdown table under README.md's "## Exit codes" heading."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    lines = [l for l in section.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:2] == ["code", "meaning"], header
    table = {}
    for line in lines[2:]:  # after the header and its --- row
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert cells[0].isdigit(), line
        assert int(cells[0]) not in table, f"code {cells[0]} twice in README"
        table[int(cells[0])] = cells[1]
    return table


def help_codes(args) -> dict[int, str]:
    out = CliRunner().invoke(main, args, terminal_width=200).output
    section = out.split("Exit codes:\n", 1)[1]
    found = {}
    for line in section.splitlines():
        m = re.fullmatch(r"\s+(\d+)\s+(\S.*)", line)
        if m:
            found[int(m.group(1))] = m.group(2).strip()
    return found


def test_readme_help_and_enum_agree():
    codes = {int(c) for c in ExitCode}
    assert set(MEANINGS) == set(ExitCode)
    readme = readme_table()
    assert set(readme) == codes
    for args in (["--help"], ["run", "--help"]):
        assert help_codes(args) == {int(c): MEANINGS[c] for c in ExitCode}, args
    for c in ExitCode:
        assert readme[int(c)] == MEANINGS[c], f"README's meaning of {int(c)} differs from exit_codes.MEANINGS"


def test_the_check_sees_a_missing_row(tmp_path, monkeypatch):
    """The parser is not vacuous: a README without code 9's row fails the comparison."""
    text = (REPO / "README.md").read_text()
    (tmp_path / "README.md").write_text("\n".join(l for l in text.splitlines() if not l.startswith("| 9 |")))
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert 9 not in readme_table()
