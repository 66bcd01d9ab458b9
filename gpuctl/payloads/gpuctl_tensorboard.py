"""TensorBoard behind a token, for `gpuctl tensorboard`: TensorBoard has no authentication of its
own, and a port on 127.0.0.1 is open to every user of the host (and, forwarded, of the laptop).

    python gpuctl_tensorboard.py LOGDIR PORT TOKEN_FILE

Serves TensorBoard's own WSGI app on 127.0.0.1:PORT, in this process, behind a check: a request
passes with the cookie this check sets, or with `?token=` (answered with the cookie and a redirect
to the same page without it, as Jupyter does); any other gets 403. The token is read from
TOKEN_FILE (the owner's alone), never from argv or the environment, which other users can read.
Runs on the instance: stdlib and TensorBoard (TensorFlow's) only; Python 3.8.
"""

import hashlib
import hmac
import sys
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, urlencode

FORBIDDEN = (b"gpuctl: this TensorBoard answers its owner only. Open the URL `gpuctl tensorboard` printed "
             b"(it carries the token).\n")


def cookie_name(token):
    """One per token: TensorBoards on other ports of 127.0.0.1 share cookies, not names."""
    return "gpuctl-tb-" + hashlib.sha256(token.encode()).hexdigest()[:12]


def guard(app, token):
    """`app` (a WSGI app) answering only requests that carry `token` (cookie or ?token=)."""
    name = cookie_name(token)

    def same(value):
        return hmac.compare_digest(value.encode("utf-8", "replace"), token.encode())

    def guarded(environ, start_response):
        try:
            jar = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        except CookieError:
            jar = SimpleCookie()
        if name in jar and same(jar[name].value):
            return app(environ, start_response)
        query = parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        given = [v for k, v in query if k == "token"]
        if given and same(given[-1]):
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            where = (environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")) or "/"
            start_response("303 See Other", [
                ("Location", where + ("?" + rest if rest else "")),
                ("Set-Cookie", "%s=%s; Path=/; HttpOnly; SameSite=Strict" % (name, token)),
                ("Cache-Control", "no-store"), ("Content-Length", "0")])
            return [b""]
        start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8"),
                                          ("Content-Length", str(len(FORBIDDEN)))])
        return [FORBIDDEN]

    return guarded


def read_token(path):
    with open(path) as fh:
        token = fh.read(256).strip()
    if len(token) < 16 or not all(c.isalnum() or c in "-_" for c in token):
        sys.exit("gpuctl: no usable token in %s" % path)
    return token


def main(argv):
    logdir, port, token_file = argv[1:4]
    token = read_token(token_file)
    from tensorboard import program

    def server(app, flags):
        return program.WerkzeugServer(guard(app, token), flags)

    tb = program.TensorBoard(server_class=server)
    tb.configure(argv=["tensorboard", "--logdir", logdir, "--host", "127.0.0.1", "--port", port])
    return tb.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
