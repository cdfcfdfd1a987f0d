package control

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
)

// NonceSize is the length of each side's challenge.
const NonceSize = 32

// MinSecretSize is the shortest secret the server and client accept: a
// secret short enough to guess makes the HMAC pointless.
const MinSecretSize = 16

const (
	labelBridge = "fabricbridge-control-v1 bridge"
	labelApp    = "fabricbridge-control-v1 app"
)

// proof is the MAC one side sends to show it knows the secret; label says
// which side, so that neither MAC can stand in for the other.
func proof(secret []byte, label, app string, clientNonce, serverNonce []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	m.Write([]byte{0})
	m.Write([]byte(app))
	m.Write([]byte{0})
	m.Write(clientNonce)
	m.Write(serverNonce)
	return m.Sum(nil)
}

func nonce() []byte {
	b := make([]byte, NonceSize)
	rand.Read(b) // never fails (crypto/rand panics rather than return short)
	return b
}
