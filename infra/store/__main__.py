"""`python -m infra.store FILE...`: the sha256 the store keeps for local files, printed as ``sha256sum`` prints
it (the digest, two spaces, the path)."""

import argparse

from infra.store.io import file_sha256


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m infra.store", description="Print the sha256 of local files "
                                     "as the store keeps it (ArtifactRef.sha256, MANIFEST.json entries).")
    parser.add_argument("files", nargs="+", metavar="FILE", help="files to hash")
    for path in parser.parse_args(argv).files:
        try:
            digest = file_sha256(path)
        except OSError as exc:
            parser.exit(1, f"{parser.prog}: cannot read {path}: {exc.strerror}\n")
        print(f"{digest}  {path}")


if __name__ == "__main__":
    main()
