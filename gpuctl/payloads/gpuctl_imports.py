"""Run code right after a module is first imported (a post-import hook). Stdlib only; Python 3.8+.

The launcher uses it so that TensorFlow is imported only by scripts that import it themselves: a
plain-Python job starts in milliseconds, and a Keras script still gets its reports and checkpoints,
set up the moment its own `import tensorflow` (or `keras`, `tf_keras`) returns.

The hook runs when the OUTERMOST watched import completes, never in the middle of one: standalone
`import keras` imports TensorFlow half-way through its own import, and touching `tf.keras` there
would import the half-made `keras` again. Imports on other threads count apart (one depth each).
"""

import sys
import threading


class ImportWatch(object):
    """A `sys.meta_path` finder for the top-level modules `names`: it finds them through the other
    finders, as Python would, and wraps their loader so that `on_import()` runs once the outermost
    of them has executed. The wrapper steps aside before the module's code runs (the module's
    `__loader__` and `__spec__.loader` are the real loader's)."""

    def __init__(self, names, on_import):
        self.names = frozenset(names)
        self.on_import = on_import
        self.local = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec

    def depth(self):
        return getattr(self.local, "depth", 0)

    def _enter(self):
        self.local.depth = self.depth() + 1

    def _leave(self, ok):
        self.local.depth = self.depth() - 1
        if ok and self.local.depth == 0:
            self.on_import()

    def install(self):
        """First on sys.meta_path; the hook runs now if one of the modules is already imported."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        if any(name in sys.modules for name in self.names):
            self.on_import()
        return self

    def uninstall(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _Loader(object):
    def __init__(self, loader, watch):
        self.loader = loader
        self.watch = watch

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # The real loader from here on: the module's code sees only it (resources, get_source).
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.watch._enter()
        ok = False
        try:
            self.loader.exec_module(module)
            ok = True
        finally:
            self.watch._leave(ok)

    def __getattr__(self, name):  # anything else a caller asks of a loader
        if name == "loader":  # not set yet (a copy made without __init__): no endless lookup
            raise AttributeError(name)
        return getattr(self.loader, name)
