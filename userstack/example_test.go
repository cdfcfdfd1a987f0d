package userstack_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"

	"github.com/fabricbridge/fabricbridge/userstack"
)

// An application on the bridge's host opens its stack through the daemon's
// control socket, under the name the daemon's configuration gives it. It
// serves HTTP on a net.Listener like any other: the bridge steers port 80
// to this application once Listen has claimed it. It dials out with a
// net.Conn: the bridge reserves the source port and installs the flow
// before the stack sends the SYN, so the answer reaches this stack and not
// the kernel.
//
// This example needs a running fabricbridge daemon, so go test compiles it
// but does not run it.
func ExampleOpen() {
	ctx := context.Background()
	s, err := userstack.Open(ctx, userstack.Options{
		App:     "web",
		Control: "/run/fabricbridge/control.sock",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	l, err := s.Listen("tcp", ":80")
	if err != nil {
		log.Fatal(err)
	}
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "served by a user-space stack")
	}))

	c, err := s.Dial(ctx, "tcp", "198.18.0.1:80")
	if err != nil {
		log.Fatal(err) // errors.Is(err, syscall.ECONNREFUSED) and the like hold as for kernel sockets
	}
	defer c.Close()
	fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: example\r\n\r\n")
	reply, err := io.ReadAll(c)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d bytes\n", len(reply))
}
