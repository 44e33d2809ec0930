import socket
def raw(data):
    s=socket.socket(); s.settimeout(3); s.connect(('127.0.0.1',52080)); s.sendall(data)
    out=b''
    try:
        while True:
            d=s.recv(65536)
            if not d: break
            out+=d
    except Exception: pass
    return out
for host in [b'127.0.0.1:52080', b'localhost', b'LOCALHOST:1', b'evil.example', b'evil.example:52080', b'localhost.evil.example', b'127.0.0.1.nip.io', b'[::1]', b'[::1]evil.example', b'[::1].evil.example', b'[::ffff:127.0.0.1]', b'127.1', b'0.0.0.0', b'2130706433', b'localhost:52080, evil.example', b'', None, b'localhost.', b'evil.example:127.0.0.1', b'127.0.0.1:evil']:
    for path in [b'/v1/packs', b'/console/']:
        req=b'GET '+path+b' HTTP/1.1\r\n'+(b'Host: '+host+b'\r\n' if host is not None else b'')+b'Connection: close\r\n\r\n'
        out=raw(req)
        print(host, path, out.split(b'\r\n')[0], out.partition(b'\r\n\r\n')[2][:90])
# two Host headers
out=raw(b'GET /v1/packs HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n'); print('two hosts', out.split(b'\r\n')[0], out.partition(b'\r\n\r\n')[2][:90])
out=raw(b'GET /v1/packs HTTP/1.1\r\nHost: evil.example\r\nHost: localhost\r\nConnection: close\r\n\r\n'); print('two hosts rev', out.split(b'\r\n')[0], out.partition(b'\r\n\r\n')[2][:90])
out=raw(b'GET http://localhost/v1/packs HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n'); print('absolute-form', out.split(b'\r\n')[0], out.partition(b'\r\n\r\n')[2][:90])
out=raw(b'GET /v1/packs HTTP/1.0\r\n\r\n'); print('HTTP/1.0 no host', out.split(b'\r\n')[0], out.partition(b'\r\n\r\n')[2][:90])
# CSRF simple requests from cross-site with loopback Host
for ct in [b'text/plain', b'application/x-www-form-urlencoded', b'multipart/form-data; boundary=x']:
    body=b'{"principal":"mallory"}'
    out=raw(b'POST /v1/packs/github/grants HTTP/1.1\r\nHost: 127.0.0.1:52080\r\nOrigin: https://evil.example\r\nContent-Type: '+ct+b'\r\nContent-Length: '+str(len(body)).encode()+b'\r\nConnection: close\r\n\r\n'+body)
    print('csrf', ct, out.split(b'\r\n')[0])
