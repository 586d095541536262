"""botocore's data loader, minus a scan of every AWS service at each process's first client, and
with a faster JSON parser.

Building a client checks that its service exists with ``Loader.list_available_services``, which
lists each of botocore's ~440 service folders and the API versions in each: 20 ms of the ~55 ms an
S3 client took to build, paid once by every process that stages, streams or uploads (twice: for the
service model and for its endpoint rules). Here the check looks in the one service's folder; the
full list is still built for anything that reads it (an unknown service's error message lists it).
It is a ``Sequence``, not a ``list``: enough for botocore and boto3 building clients, which is all
this loader is for (it serves only the session ``trainyard.s3`` builds its S3 client from).

The model files themselves (the S3 API, 1.4 MB; every region's endpoints, 1.3 MB; the endpoint rules)
are parsed with orjson into plain dicts (``JSONFiles``), not with ``json`` into ``OrderedDict``s: 48 ms
-> 15 ms of each such process's first client. botocore needs no more than a dict's kept insertion order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import botocore.session
import orjson
from botocore.exceptions import DataNotFoundError
from botocore.loaders import JSONFileLoader, Loader


class KnownServices(Sequence):
    """The services that have a ``type_name`` model: membership asks one folder, the rest lists all."""

    def __init__(self, loader: Loader, type_name: str):
        self._loader, self._type_name = loader, type_name
        self._names: list[str] | None = None

    def __contains__(self, name: object) -> bool:
        try:
            return isinstance(name, str) and bool(self._loader.list_api_versions(name, self._type_name))
        except DataNotFoundError:
            return False

    def __getitem__(self, index):
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def _all(self) -> list[str]:
        if self._names is None:
            self._names = Loader.list_available_services(self._loader, self._type_name)
        return self._names


class JSONFiles(JSONFileLoader):
    """botocore's file loader, parsing botocore's own data with orjson; other files (``AWS_DATA_PATH``,
    ``~/.aws/models``) as botocore does: orjson reads an integer past 64 bits as a float, and only
    botocore's own files are known to hold none (``tests/unit/test_s3.py`` compares the S3 client's)."""

    BOTOCORE_DATA = os.path.join(Loader.BUILTIN_DATA_PATH, "")

    def _load_file(self, full_path, open_method):
        if not full_path.startswith(self.BOTOCORE_DATA):
            return super()._load_file(full_path, open_method)
        if not os.path.isfile(full_path):
            return None
        with open_method(full_path, "rb") as fp:
            return orjson.loads(fp.read())


class QuickLoader(Loader):
    """A ``Loader`` whose ``list_available_services`` answers membership without the full scan, and
    whose files are parsed by ``JSONFiles``."""

    FILE_LOADER_CLASS = JSONFiles

    def list_available_services(self, type_name: str) -> KnownServices:
        return KnownServices(self, type_name)


def session() -> botocore.session.Session:
    """A botocore session (for ``boto3.session.Session(botocore_session=...)``) that loads with ``QuickLoader``.

    Search paths as botocore's own loader has them: its data, ``~/.aws/models``, and ``AWS_DATA_PATH``.
    """
    core = botocore.session.get_session()
    extra = core.get_config_variable("data_path")
    paths = [os.path.expanduser(os.path.expandvars(p)) for p in extra.split(os.pathsep)] if extra else []
    core.register_component("data_loader", QuickLoader(extra_search_paths=paths))
    return core
