"""The manifest parser: valid manifests parse with defaults filled in; every invalid one is
refused with every problem located; no input whatever makes it crash."""

from __future__ import annotations

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.contract.errors import ManifestError
from daemon.contract.jobspec import InputFile, Role
from daemon.core.manifest import check_relative_path, pairing_problems, parse_manifest
from daemon.core.manifest_schema import InferenceParams, Kind, TrainingParams


def doc(**overrides: object) -> bytes:
    base: dict[str, object] = {
        "watchd": 1,
        "kind": "inference",
        "owner": {"name": "Anna Expert", "email": "anna@example.org"},
        "model": {"name": "spheroid-unet", "version": "latest"},
        "files": [{"path": "images/a.png", "size": 100}],
    }
    base.update(overrides)
    return tomli_w.dumps({k: v for k, v in base.items() if v is not None}).encode()


def problems_of(data: bytes) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data)
    return [p.render() for p in info.value.problems]


def test_a_valid_inference_manifest_parses_with_default_parameters() -> None:
    manifest = parse_manifest(doc())
    assert manifest.kind is Kind.INFERENCE
    assert manifest.model.name == "spheroid-unet" and manifest.model.version == "latest"
    assert manifest.params == InferenceParams().model_dump()
    assert manifest.params["threshold"] == 0.5 and manifest.params["min_object_area"] == 0
    assert manifest.files[0] == InputFile("images/a.png", 100, None, Role.IMAGE)
    assert len(manifest.sha256) == 64


def test_a_training_manifest_pairs_images_and_masks_by_file_name() -> None:
    files = [
        {"path": "images/a.png", "size": 1},
        {"path": "masks/a.png", "size": 1, "role": "mask"},
    ]
    manifest = parse_manifest(doc(kind="training", model={"name": "m"}, files=files))
    assert manifest.params == TrainingParams().model_dump()
    assert [f.role.value for f in manifest.files] == ["image", "mask"]


def test_training_refuses_images_without_masks_and_a_version() -> None:
    files = [
        {"path": "images/a.png", "size": 1},
        {"path": "masks/b.png", "size": 1, "role": "mask"},
    ]
    found = problems_of(doc(kind="training", model={"name": "m", "version": 3}, files=files))
    assert (
        "manifest.toml, model.version: is chosen by the registry for a training batch — remove it"
        in found
    )
    assert "manifest.toml, image 'images/a.png': has no mask with the same file name" in found
    assert "manifest.toml, mask 'masks/b.png': has no image with the same file name" in found


def test_every_problem_is_reported_at_once_with_its_location() -> None:
    found = problems_of(
        doc(
            watchd=2,
            kind="inferense",
            colour="red",
            model={"name": "../evil"},
            files=[
                {"path": "../etc/passwd", "size": 1},
                {"path": "/abs/x.png", "size": -1},
                {"path": "results/old.png"},
                {"path": "a.png", "sha256": "zz"},
                {"path": "a.png"},
            ],
        )
    )
    assert "manifest.toml, watchd: Input should be 1 (got 2)" in found
    assert any(
        f.startswith("manifest.toml, kind: Input should be 'training', 'inference' or 'sweep'")
        for f in found
    )
    assert any(
        "unknown key 'colour' (valid keys: files, kind, model, owner, params, patterns, resources, sweep, title, watchd)"
        in f
        for f in found
    )
    assert any(f.startswith("manifest.toml, model.name: must be 1 to 64 letters") for f in found)
    assert (
        "manifest.toml, files[0] '../etc/passwd': path goes up with '..'; inputs must be inside the batch folder"
        in found
    )
    assert (
        "manifest.toml, files[1] '/abs/x.png': path is an absolute path; name files relative to the batch folder"
        in found
    )
    assert (
        "manifest.toml, files[1] '/abs/x.png': size: Input should be greater than or equal to 0 (got -1)"
        in found
    )
    assert (
        "manifest.toml, files[2] 'results/old.png': path is inside 'results/', which watchd writes"
        in found
    )
    assert any(
        f.startswith("manifest.toml, files[3] 'a.png': sha256: must be 64 hexadecimal digits")
        for f in found
    )
    assert "manifest.toml, files[4] 'a.png': is listed twice (also files[3])" in found


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "manifest.toml: is empty"),
        (b"  \n", "manifest.toml: is empty"),
        (b"\xff\xfekind", "manifest.toml: is not UTF-8 text (byte 0xff at offset 0)"),
        (b"watchd = [", "manifest.toml: not valid TOML"),
        (b"# just a comment\n", "manifest.toml: is empty"),
    ],
)
def test_unreadable_manifests_get_one_clear_problem(data: bytes, expected: str) -> None:
    assert problems_of(data)[0].startswith(expected)


def test_a_huge_manifest_is_refused_before_parsing() -> None:
    found = problems_of_limit(b"x" * 2048, 1024)
    assert found == [
        "manifest.toml: is 2 048 bytes, more than the 1 024 allowed — "
        "list the inputs with [[patterns]] instead of one [[files]] entry each"
    ]


def problems_of_limit(data: bytes, limit: int) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, max_bytes=limit)
    return [p.render() for p in info.value.problems]


def test_parameters_are_bounded_and_unknown_ones_listed() -> None:
    found = problems_of(doc(params={"threshold": 2.0, "treshold": 0.1}))
    assert "manifest.toml, params.threshold: Input should be less than 1 (got 2.0)" in found
    assert (
        "manifest.toml, params.treshold: unknown key 'treshold' (valid keys: batch_size, channel, glass_tolerance, gpu_batch_size, gpu_compile, max_whole_pixels, min_object_area, mixed_precision, split_neck, threshold, tile_overlap, tile_size)"
        in found
    )


def test_gpu_compile_is_off_by_default_and_only_its_three_values_are_accepted() -> None:
    assert parse_manifest(doc()).params["gpu_compile"] == "off"
    for mode in ("off", "compile", "graphs"):
        assert parse_manifest(doc(params={"gpu_compile": mode})).params["gpu_compile"] == mode
    assert problems_of(doc(params={"gpu_compile": "fast"})) == [
        "manifest.toml, params.gpu_compile: Input should be 'off', 'compile' or 'graphs' "
        "(got 'fast')"
    ]
    assert problems_of(doc(params={"gpu_compile": True})) == [
        "manifest.toml, params.gpu_compile: Input should be 'off', 'compile' or 'graphs' (got True)"
    ]


def test_augmentations_are_on_by_default_for_training_bounded_and_can_be_turned_off() -> None:
    files = [{"path": "images/a.png", "size": 1}, {"path": "masks/a.png", "size": 1, "role": "mask"}]
    training = parse_manifest(doc(kind="training", model={"name": "m"}, files=files)).params
    assert training["augment_flips"] and training["augment_turns"]
    assert training["augment_gamma"] == 0.4 and training["augment_noise"] == 0.03
    off = {"augment_turns": False, "augment_blur": 0, "augment_vignetting": 0.0}
    assert parse_manifest(doc(kind="training", model={"name": "m"}, files=files,
                              params=off)).params["augment_blur"] == 0  # fmt: skip
    found = problems_of(doc(kind="training", model={"name": "m"}, files=files,
                            params={"augment_blur": 20, "augment_noise": -0.1}))  # fmt: skip
    assert found == [
        "manifest.toml, params.augment_blur: Input should be less than or equal to 10 (got 20)",
        "manifest.toml, params.augment_noise: Input should be greater than or equal to 0 "
        "(got -0.1)",
    ]
    assert problems_of(doc(params={"split_neck": 1})) == [
        "manifest.toml, params.split_neck: Input should be less than 1 (got 1)"
    ]
    assert parse_manifest(doc()).params["split_neck"] == 0.93


def test_a_tile_overlap_of_half_a_window_or_more_is_refused() -> None:
    """Windows advance by tile_size - tile_overlap: 64/63 would segment each pixel ~4000 times."""
    assert problems_of(doc(params={"tile_size": 64, "tile_overlap": 63})) == [
        "manifest.toml, params.tile_overlap: must be less than half of tile_size (64): "
        "at most 31 (got 63)"
    ]
    assert problems_of(doc(params={"tile_overlap": 256})) == [
        "manifest.toml, params.tile_overlap: must be less than half of tile_size (512): "
        "at most 255 (got 256)"
    ]
    accepted = parse_manifest(doc(params={"tile_size": 64, "tile_overlap": 31})).params
    assert (accepted["tile_size"], accepted["tile_overlap"]) == (64, 31)
    wrong_size = problems_of(doc(params={"tile_size": 10, "tile_overlap": 500}))
    assert wrong_size == [
        "manifest.toml, params.tile_size: Input should be greater than or equal to 64 (got 10)"
    ]


def test_a_manifest_without_inputs_or_owner_is_refused() -> None:
    found = problems_of(doc(files=[], owner=None))
    assert any(f.startswith("manifest.toml, owner: required key is missing") for f in found)


@pytest.mark.parametrize(
    "path",
    [
        "../x.png",
        "a/../../x.png",
        "/etc/passwd",
        "C:/x.png",
        "a\\b.png",
        "results/x.png",
        "manifest.toml",
        "watchd-status.txt",
        "a\x00b",
        ".",
        "dir/",
    ],
)
def test_paths_that_could_leave_the_folder_or_touch_watchd_files_are_refused(path: str) -> None:
    assert check_relative_path(path) is not None


@pytest.mark.parametrize("path", ["a.png", "images/sub dir/ä 'q'.tif", "./a.png", "a/./b.png"])
def test_ordinary_relative_paths_are_accepted(path: str) -> None:
    assert check_relative_path(path) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_the_parser(data: bytes) -> None:
    try:
        parse_manifest(data)
    except ManifestError as exc:
        assert exc.problems and all(p.message for p in exc.problems)


toml_scalars = st.one_of(
    st.integers(-10, 10**6), st.floats(allow_nan=False), st.text(max_size=20), st.booleans()
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["watchd", "kind", "title", "owner", "model", "params", "files", "x"]),
        st.one_of(
            toml_scalars,
            st.dictionaries(st.text(max_size=8), toml_scalars, max_size=3),
            st.lists(
                st.dictionaries(
                    st.sampled_from(["path", "size", "sha256", "role"]), toml_scalars, max_size=4
                ),
                max_size=3,
            ),
        ),
    )
)
def test_arbitrary_documents_are_either_valid_or_refused_with_problems(document: dict) -> None:
    data = tomli_w.dumps(document).encode()
    try:
        manifest = parse_manifest(data)
    except ManifestError as exc:
        assert exc.problems
        return
    for f in manifest.files:  # anything accepted is safe to join to the batch folder
        assert check_relative_path(f.path) is None


segments = st.text(alphabet=st.characters(blacklist_characters="/\\\x00"), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(segments, st.just(".."), st.just(".")), min_size=1, max_size=6))
def test_no_accepted_path_climbs_out_of_the_folder(parts: list[str]) -> None:
    import posixpath

    path = "/".join(parts)
    if check_relative_path(path) is None:
        normal = posixpath.normpath(path)
        # (a name that merely starts with two dots, "..0", is a name: CI's random draw found it)
        assert normal.split("/")[0] != ".." and not posixpath.isabs(normal)
        assert ".." not in normal.split("/")


def test_pairing_lists_images_without_masks() -> None:
    found = pairing_problems(
        [InputFile("i/a.png", 1), InputFile("m/a.tif", 1, role=Role.MASK), InputFile("i/b.png", 1)]
    )
    assert [p.render() for p in found] == [
        "manifest.toml, image 'i/b.png': has no mask with the same file name"
    ]


REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name", ["inference.toml", "training.toml", "inference-patterns.toml", "sweep.toml"]
)
def test_the_documented_examples_are_valid(name: str) -> None:
    parse_manifest((REPO / "docs" / "examples" / name).read_bytes())


def test_the_published_schema_matches_the_parser() -> None:
    import json

    from daemon.core.manifest_schema import ManifestModel

    published = json.loads((REPO / "docs" / "manifest.schema.json").read_text())
    assert published == ManifestModel.model_json_schema()


PAIRED = [
    {"path": "images/a.png", "size": 1},
    {"path": "masks/a.png", "size": 1, "role": "mask"},
]


def sweep_doc(sweep: dict[str, object], **overrides: object) -> bytes:
    return doc(kind="sweep", model={"name": "m"}, files=PAIRED, sweep=sweep, **overrides)


def test_a_grid_sweep_expands_to_the_product_of_its_value_lists_in_order() -> None:
    space = {"learning_rate": [0.01, 0.001], "width": [8, 16, 32]}
    manifest = parse_manifest(sweep_doc({"method": "grid", "space": space}))
    assert manifest.kind is Kind.SWEEP and manifest.sweep is not None
    assert [dict(t) for t in manifest.sweep.trials] == [
        {"learning_rate": lr, "width": w} for lr in (0.01, 0.001) for w in (8, 16, 32)
    ]
    assert manifest.params == TrainingParams().model_dump()
    capped = parse_manifest(sweep_doc({"method": "grid", "trials": 4, "space": space}))
    assert capped.sweep is not None and len(capped.sweep.trials) == 4


def test_a_random_sweep_draws_the_same_trials_for_the_same_seed_within_bounds() -> None:
    sweep = {
        "method": "random",
        "trials": 6,
        "seed": 3,
        "space": {
            "learning_rate": {"min": 1e-4, "max": 1e-2, "log": True},
            "depth": {"min": 2, "max": 4},
        },
    }
    first, second = parse_manifest(sweep_doc(sweep)), parse_manifest(sweep_doc(sweep))
    assert first.sweep is not None and second.sweep is not None
    assert first.sweep.trials == second.sweep.trials and len(first.sweep.trials) == 6
    for trial in first.sweep.trials:
        assert 1e-4 <= trial["learning_rate"] <= 1e-2
        assert trial["depth"] in (2, 3, 4) and isinstance(trial["depth"], int)
    other = parse_manifest(sweep_doc({**sweep, "seed": 4}))
    assert other.sweep is not None and other.sweep.trials != first.sweep.trials


def test_a_sweep_refuses_unknown_and_out_of_bound_parameters_and_grid_ranges() -> None:
    found = problems_of(
        sweep_doc(
            {
                "method": "grid",
                "space": {
                    "colour": [1],
                    "epochs": [10, 1000],
                    "learning_rate": {"min": 0.1, "max": 0.2},
                },
            }
        )
    )
    assert found[0].startswith(
        "manifest.toml, sweep.space.colour: is not a training parameter — use one of: "
    )
    assert (
        "manifest.toml, sweep.space.epochs: 1000: Input should be less than or equal to 500 (got 1000)"
        in found
    )
    assert (
        'manifest.toml, sweep.space.learning_rate: a range needs method = "random" — list the values instead'
        in found
    )


def test_a_sweep_needs_its_section_and_other_kinds_refuse_one() -> None:
    assert problems_of(doc(kind="sweep", model={"name": "m"}, files=PAIRED)) == [
        "manifest.toml, sweep: is missing — add [sweep] with method, trials and a [sweep.space] (see docs/manifest.md)"
    ]
    found = problems_of(doc(sweep={"space": {"width": [8]}}))
    assert found == ["manifest.toml, sweep: is for kind = \"sweep\", not 'inference'"]


@pytest.mark.parametrize("glob", ["img**.png", "images/**x/*.png", "images//*.png", "images/**"])
def test_a_glob_that_pathlib_cannot_use_is_refused_at_once(glob: str) -> None:
    found = problems_of(doc(files=[], patterns=[{"glob": glob}]))
    assert found[0].startswith(f"manifest.toml, patterns[0] '{glob}': glob ")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"title": "Plate 7\nState:     DONE"},
            "manifest.toml, title: must be one line of plain text, without control or formatting "
            "characters (it contains \\n) (got 'Plate 7\\nState:     DONE')",
        ),
        (
            {"owner": {"name": "\x1b[2J\x1b]0;owned\x07Eve\u202e"}},
            "manifest.toml, owner.name: must be one line of plain text, without control or "
            "formatting characters (it contains \\x1b, \\x07, \\u202e) "
            "(got '\\x1b[2J\\x1b]0;owned\\x07Eve\\u202e')",
        ),
        (
            {"title": "a\ttab"},
            "manifest.toml, title: must be one line of plain text, without control or formatting "
            "characters (it contains \\t) (got 'a\\ttab')",
        ),
    ],
)
def test_a_title_or_owner_name_with_control_characters_is_refused_naming_them(
    overrides: dict[str, object], expected: str
) -> None:
    assert problems_of(doc(**overrides)) == [expected]


def test_a_title_and_owner_name_may_hold_spaces_brackets_and_any_script() -> None:
    manifest = parse_manifest(
        doc(title="Zellkern [bold] Übersicht  ✓", owner={"name": "[/] 山田 ‘Ann’"})
    )
    assert (manifest.title, manifest.owner_name) == (
        "Zellkern [bold] Übersicht  ✓",
        "[/] 山田 ‘Ann’",
    )


def test_a_utf8_byte_order_mark_is_accepted() -> None:
    """Windows editors start a UTF-8 file with one; TOML itself would refuse it at line 1."""
    manifest = parse_manifest(b"\xef\xbb\xbf" + doc())
    assert manifest.kind is Kind.INFERENCE
    assert manifest.raw == doc().decode()


@pytest.mark.parametrize(
    "text",
    [
        "x = " + "[" * 5000 + "]" * 5000,  # the parser itself would recurse 5 000 deep
        "x = " + "{a = " * 40 + "1" + "}" * 40,
        "[params]\n" + "a." * 5000 + "b = 1",  # dotted keys: parsed flat, nested in the document
        "title." + "a." * 40 + "b = 1",
    ],
    ids=["arrays", "inline-tables", "dotted-keys", "dotted-title"],
)
def test_a_manifest_nested_too_deep_is_one_clear_problem(text: str) -> None:
    assert problems_of(text.encode()) == [
        "manifest.toml: is nested more than 32 levels deep — a manifest's tables and lists nest"
        " a few levels at most; see docs/manifest.md"
    ]


def test_brackets_in_strings_and_comments_do_not_count_as_nesting() -> None:
    deep = "[" * 40
    text = doc(title=deep).decode() + f"# {deep}\n" + f"[params]\nthreshold = 0.4 # {deep}\n"
    text += f"[[patterns]]\nglob = '{deep}*.png'\n" + f'x = """\n{deep}\n"""\n'
    found = problems_of(text.encode())
    assert not any("nested" in p for p in found)
    assert any("unknown key 'x'" in p for p in found)  # parsed: the rest was judged


def test_a_parser_that_runs_out_of_stack_anyway_gives_the_same_problem() -> None:
    """Below the bound, but on a stack made too small for it: RecursionError becomes the
    problem, never an exception out of the parser."""
    import sys

    text = ("x = " + "[" * 30 + "]" * 30).encode()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(60)
    try:
        with pytest.raises(ManifestError) as info:
            parse_manifest(text)
    finally:
        sys.setrecursionlimit(limit)
    assert info.value.problems[0].message == "is nested more than 32 levels deep"


def test_thousands_of_duplicate_entries_give_twenty_problems_and_a_count() -> None:
    head = doc(files=None).decode()
    text = head + '[[files]]\npath = "images/img_0001.png"\n' * 5000
    with pytest.raises(ManifestError) as info:
        parse_manifest(text.encode())
    found = info.value.problems
    assert len(found) == 21 and len(str(info.value)) < 3000
    assert found[0].render() == (
        "manifest.toml, files[1] 'images/img_0001.png': is listed twice (also files[0])"
    )
    assert found[-1].render() == "… and 4 979 more like these"


def test_the_same_name_in_two_unicode_normalisations_is_listed_twice() -> None:
    nfc, nfd = "images/K\u00e4fer.png", "images/Ka\u0308fer.png"
    found = problems_of(doc(files=[{"path": nfc}, {"path": nfd}]))
    assert found == [f"manifest.toml, files[1] '{nfd}': is listed twice (also files[0])"]


@pytest.mark.parametrize(
    "email",
    ["a@example.org,root", "a@example.org, root@example.org", "a@example.org;b@example.org",
     "Anna <a@example.org>", "a@example.org\r\nBcc: root@example.org", "a@example.org\n", "a@",
     "@example.org", "a@b..org"],
)  # fmt: skip
def test_an_email_must_be_exactly_one_address_and_is_refused_in_plain_words(email: str) -> None:
    found = problems_of(doc(owner={"name": "A", "email": email}))
    assert len(found) == 1
    assert found[0].startswith(
        "manifest.toml, owner.email: must be one e-mail address, such as name@example.org (got "
    )
    assert "^" not in found[0] and "pattern" not in found[0]


@pytest.mark.parametrize("email", ["anna@example.org", "a.b+lab@sub.example.org", "x@例え.jp"])
def test_ordinary_email_addresses_are_accepted(email: str) -> None:
    assert parse_manifest(doc(owner={"name": "A", "email": email})).owner_email == email


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_an_accepted_email_is_one_address_to_the_mail_library(text: str) -> None:
    from email.message import EmailMessage

    from daemon.core.manifest_schema import is_one_address

    if is_one_address(text):
        message = EmailMessage()
        message["To"] = text
        assert len(message["To"].addresses) == 1 and "\n" not in str(message["To"])


def nested_lists(depth: int, leaf: str) -> object:
    value: object = [leaf]
    for _ in range(depth - 1):
        value = [value, leaf]
    return value


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.text(alphabet="[]{}\"'#\\\n ab", max_size=12))
def test_the_text_scan_sees_the_nesting_the_parser_builds_whatever_the_strings_hold(
    depth: int, leaf: str
) -> None:
    from daemon.core.nesting import document_nests_deeper, text_nests_deeper

    document = {"x": nested_lists(depth, leaf), "y": {"z": leaf}}
    text = tomli_w.dumps(document)
    assert text_nests_deeper(text, limit=5) == (depth > 5)
    assert document_nests_deeper(document, limit=5) == (depth > 5)


def test_an_input_in_a_format_the_jobs_do_not_read_is_refused_before_any_job_runs() -> None:
    """A vendor format is named with the export to make; an Aperio SVS and a Hamamatsu NDPI
    (TIFFs) are taken."""
    files = [
        {"path": "slides/a.lif"}, {"path": "b.jpg"}, {"path": "notes"}, {"path": "c.ome.tif"},
        {"path": "slides/d.svs"}, {"path": "slides/e.NDPI"},
    ]  # fmt: skip
    found = problems_of(doc(files=files))
    assert found == [
        "manifest.toml, files[0] 'slides/a.lif': is a Leica LIF file, which watchd does not "
        "read — export the images as OME-TIFF (e.g. Fiji: File > Save As > OME-TIFF), TIFF or PNG",
        "manifest.toml, files[1] 'b.jpg': is a '.jpg' file; watchd reads PNG and TIFF images — "
        "save the image as .png or .tif",
        "manifest.toml, files[2] 'notes': has no suffix; watchd reads PNG and TIFF images — save "
        "the image as .png or .tif",
    ]
