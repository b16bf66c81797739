"""MkDocs hooks (mkdocs.yml ``hooks:``): what the site takes from the repository at build time instead of copies.

- the reference pages, generated from the code (``reference.py`` and the ``ref_*.py`` beside this file);
- the home page from README.md, the benchmark results from benchmarks/RESULTS.md and the built-in model's report
  from fusionserve/default_model/REPORT.md, with their plots: included as they are in the repository, never copied;
- every page the nav does not list, added to its folder's section (a new ``docs/guides/*.md`` joins Guides: no nav edit);
- links from a page to a repository file outside ``docs/``: to that file's page when the site has one
  (README.md, RESULTS.md, REPORT.md, a plot), else the link becomes the file's path in code, so that
  ``mkdocs build --strict`` never fails on a link a guide's author wrote for GitHub.
"""

from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference  # beside this file: mkdocs loads hooks by path, not as a package

ROOT = reference.ROOT
# repository file -> its page in the site (plots: the same path, so the files' own relative links keep working)
INCLUDED = {
    "README.md": "index.md",
    "benchmarks/RESULTS.md": "benchmarks/index.md",
    "fusionserve/default_model/REPORT.md": "benchmarks/default-model.md",
}
_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")


def _plots() -> dict[str, str]:
    """Repository path -> site path of every plot the included files show."""
    plots = {p.relative_to(ROOT).as_posix(): f"benchmarks/results/{p.name}" for p in (ROOT / "benchmarks/results").glob("*.png")}
    plots.update(
        {p.relative_to(ROOT).as_posix(): f"benchmarks/{p.name}" for p in (ROOT / "fusionserve/default_model").glob("*.png")}
    )
    return plots


def _nav_paths(nav: Any) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_paths(item) for item in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_nav_paths(v) for v in nav.values()))
    return set()


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem.replace("-", " ").capitalize()


SECTIONS = {"guides": "Guides", "concepts": "Concepts", "reference": "Reference", "benchmarks": "Benchmarks"}


def on_config(config: Any) -> Any:
    """Add every page the nav does not list to its folder's section, by title (a page under ``guides/`` to Guides;
    one at the top of ``docs/`` after the last section), so that a new page is never left out of the site."""
    nav = config.get("nav")
    if not nav:
        return config
    listed = _nav_paths(nav)
    docs = Path(config["docs_dir"])
    for path in sorted(docs.rglob("*.md")):
        rel = path.relative_to(docs).as_posix()
        if rel in listed or rel.startswith("hooks/"):
            continue
        entry = {_title(path): rel}
        section_name = SECTIONS.get(rel.split("/")[0]) if "/" in rel else None
        section = next((item for item in nav if isinstance(item, dict) and section_name in item), None)
        if section is not None:
            section[section_name] = [*section[section_name], entry]
        elif section_name is not None:
            nav.append({section_name: [entry]})
        else:
            nav.append(entry)
    return config


def on_files(files: Files, config: Any) -> Files:
    """The generated reference, the included files and their plots, as files of the site."""
    pages = dict(reference.all_pages())
    for source, target in INCLUDED.items():
        pages[target] = (ROOT / source).read_text(encoding="utf-8")
    pages["index.md"] = "---\nhide:\n  - navigation\n---\n" + pages["index.md"]  # the home page: no left sidebar
    for path, content in pages.items():
        files.append(File.generated(config, path, content=content))
    for source, target in _plots().items():
        files.append(File.generated(config, target, abs_src_path=str(ROOT / source)))
    return files


def _repo_path(page_src: str) -> str:
    """Where a page's Markdown lives in the repository (included files are where they are, not under docs/)."""
    for source, target in INCLUDED.items():
        if page_src == target:
            return source
    return f"docs/{page_src}"


def _rewrite(match: re.Match[str], page_src: str, plots: dict[str, str]) -> str:
    bang, text, target = match.groups()
    if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):  # a URL, an anchor on the page, an absolute path
        return match.group(0)
    path, _, anchor = target.partition("#")
    here = posixpath.dirname(_repo_path(page_src))
    repo = posixpath.normpath(posixpath.join(here, path)) if path else _repo_path(page_src)
    if repo.startswith("docs/"):  # a page of the site, or a broken link: mkdocs reports it
        site = repo.removeprefix("docs/")
    elif repo in INCLUDED:
        site = INCLUDED[repo]
    elif repo in plots:
        site = plots[repo]
    else:  # a file the site does not hold (source code, a config): name it
        if bang:
            return f"`{repo}`"
        return f"`{repo}`" if text.strip("`") in (path, repo, posixpath.basename(repo)) else f"{text} (`{repo}`)"
    new = posixpath.relpath(site, posixpath.dirname(page_src) or ".")
    return f"{bang}[{text}]({new}{'#' + anchor if anchor else ''})"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Links written for the repository (GitHub) made to work in the site; code blocks are left alone."""
    plots = _plots()
    src = page.file.src_uri
    markdown = markdown.replace("<!-- extras -->", reference.extras_table())
    parts = re.split(r"(^```.*?^```)", markdown, flags=re.M | re.S)
    for i in range(0, len(parts), 2):  # the even parts are outside fenced code
        parts[i] = _LINK.sub(lambda m: _rewrite(m, src, plots), parts[i])
    return "".join(parts)
