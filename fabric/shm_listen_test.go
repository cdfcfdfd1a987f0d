package fabric

import "net"

// shmListener accepts applications on a Unix socket path and gives each a
// fresh stream.
type shmListener struct {
	l   *net.UnixListener
	cfg Config
}

// listenShm listens on a Unix socket path. Permissions on the path decide
// which local users may attach.
func listenShm(path string, cfg Config) (*shmListener, error) {
	if _, err := computeLayout(cfg); err != nil {
		return nil, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	return &shmListener{l: l, cfg: cfg}, nil
}

// Accept waits for one application and hands it a new stream.
func (l *shmListener) Accept() (*BridgeStream, error) {
	c, err := l.l.AcceptUnix()
	if err != nil {
		return nil, err
	}
	s, err := NewShm(l.cfg)
	if err != nil {
		c.Close()
		return nil, err
	}
	if err := s.Handover(c); err != nil {
		c.Close()
		s.Close()
		return nil, err
	}
	return s, nil
}

// Close stops listening.
func (l *shmListener) Close() error { return l.l.Close() }

// dialShm connects to a bridge listening on path and attaches the stream it
// hands over.
func dialShm(path string) (*Stream, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	s, err := AttachShm(c)
	if err != nil {
		c.Close()
		return nil, err
	}
	return s, nil
}
