// Package argsjson decodes a typed task's payload into its Args type the
// one way the runner (package shardrun) and the test helpers
// (shardruntest) both use.
package argsjson

import (
	"encoding/json"
	"reflect"
)

// Zero is A's zero value, or a new value when A is a pointer type, so
// that a method on the pointer (Kind) can be called and a payload decoded
// into it.
func Zero[A any]() A {
	var a A
	if t := reflect.TypeFor[A](); t.Kind() == reflect.Pointer {
		a = reflect.New(t.Elem()).Interface().(A)
	}
	return a
}

// Decode decodes payload into a new A.
func Decode[A any](payload []byte) (A, error) {
	a := Zero[A]()
	into := any(&a)
	if reflect.TypeFor[A]().Kind() == reflect.Pointer {
		into = a
	}
	err := json.Unmarshal(payload, into)
	return a, err
}
