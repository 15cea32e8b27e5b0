from pathlib import Path

from dmd2.options_reference import options_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def test_the_option_reference_is_up_to_date():
    assert PAGE.read_text() == options_markdown(), (
        "docs/options.md is stale: run `python -m dmd2.options_reference > docs/options.md`")


def test_every_option_appears_with_its_doc():
    import dataclasses
    from dmd2.config import SECTION_TYPES

    page = options_markdown()
    for section, cls in SECTION_TYPES.items():
        assert f"## [{section}]" in page
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in page and field.metadata["doc"] in page
