//go:build !race

package userstack

const raceEnabled = false
