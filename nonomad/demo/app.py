"""The demo app `make up` deploys: answers every GET with who served it."""

import http.server
import os


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = (
            f"hello from machine {os.environ['MACHINE_ID']} of app {os.environ['APP']} "
            f"in region {os.environ['REGION']}\n"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        print(self.address_string(), self.requestline, flush=True)


if __name__ == "__main__":
    port = int(os.environ["PORT"])
    # Every interface of its own: in its sandbox the machine's loopback and its address, which
    # a proxy on another host dials when its worker routes machines (flyd --route-machines).
    print(f"demo listening on 0.0.0.0:{port}", flush=True)
    http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
