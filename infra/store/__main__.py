"""`python -m infra.store FILE...`: the store's digest of local files, as sha256sum prints a plain one."""

import argparse

from infra.store.digest import file_digest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m infra.store",
        description="Print the artifact store's digest of local files (what ArtifactRef.sha256 "
        "and MANIFEST.json entries hold), like sha256sum prints a plain sha256.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="files to hash")
    args = parser.parse_args(argv)
    for path in args.files:
        try:
            digest, _ = file_digest(path)
        except OSError as exc:
            parser.exit(1, f"{parser.prog}: cannot read {path}: {exc.strerror}\n")
        print(f"{digest}  {path}")


if __name__ == "__main__":
    main()
