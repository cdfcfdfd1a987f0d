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
// control socket, under the name the daemon's configuration gives it, and
// serves HTTP on a net.Listener like any other. The bridge steers the
// listener's port to this application only once Listen has claimed it.
//
// This example needs a running fabricbridge daemon, so it is compiled but
// not run by go test.
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
	log.Fatal(http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "served by a user-space stack")
	})))
}

// Dial opens an outgoing connection from one of the application's
// addresses; the bridge reserves the source port and installs the flow
// before the stack sends the SYN, so the answer reaches this stack and not
// the kernel.
//
// This example needs a running fabricbridge daemon, so it is compiled but
// not run by go test.
func ExampleStack_Dial() {
	ctx := context.Background()
	s, err := userstack.Open(ctx, userstack.Options{
		App:     "web",
		Control: "/run/fabricbridge/control.sock",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()

	c, err := s.Dial(ctx, "tcp", "198.18.0.1:80")
	if err != nil {
		log.Fatal(err) // errors.Is(err, syscall.ECONNREFUSED) etc. hold as for kernel sockets
	}
	defer c.Close()
	fmt.Fprintf(c, "GET / HTTP/1.0\r\nHost: example\r\n\r\n")
	reply, err := io.ReadAll(c)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%d bytes\n", len(reply))
}
